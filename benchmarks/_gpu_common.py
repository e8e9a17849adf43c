"""Helpers shared by the GPU benchmark scripts: child processes (FlashInfer JIT-compiles
each kernel variant once, ~70 s, so independent work runs in parallel processes, each with
its own JIT cache directory unless it shares one on purpose), result lines and output."""

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "FLASHFIX_RESULT="
sys.path.insert(0, REPO)


def emit(payload):
    """Print one result line (a child reports each row as soon as it has it)."""
    print(RESULT + json.dumps(payload, default=repr), flush=True)


def cache_dir(name):
    base = os.environ.get("FLASHFIX_GPU_CACHE") or os.path.join(tempfile.gettempdir(), "flashfix-gpu-cache")
    path = os.path.join(base, name)
    os.makedirs(path, exist_ok=True)
    return path


class Child:
    """``python <script> <args>`` in the background; its result lines are collected as they come."""

    def __init__(self, script, args, cache, env=None, deadline=None, label=None):
        full = dict(os.environ)
        full["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in full.get("PYTHONPATH", "").split(os.pathsep) if p])
        full["FLASHINFER_WORKSPACE_BASE"] = cache
        full["PYTHONUNBUFFERED"] = "1"
        full.setdefault("MAX_JOBS", "4")
        full.update(env or {})
        self.label = label or " ".join(args)
        self.results, self.log = [], []
        self.start = time.time()
        self.proc = subprocess.Popen([sys.executable, script] + list(args), env=full, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.deadline = deadline
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                self.results.append(json.loads(line[len(RESULT):]))
            else:
                self.log.append(line.rstrip())

    def wait(self):
        timeout = None if self.deadline is None else max(1.0, self.deadline - time.time())
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.log.append("killed at the deadline")
        self.thread.join(timeout=10)
        self.wall_s = round(time.time() - self.start, 1)
        return self

    def failed(self):
        return self.proc.returncode != 0

    def tail(self, n=25):
        return "\n".join(self.log[-n:])


def deadline_from(argv_value):
    """A wall-clock deadline ``argv_value`` seconds from now (None for no deadline)."""
    return None if not argv_value else time.time() + float(argv_value)


def header(info):
    return "GPU: %s (SM %s), FlashInfer %s, torch %s, CUDA %s, flashfix %s" % (
        info.get("gpu"), info.get("capability"), info.get("flashinfer"), info.get("torch"), info.get("cuda"),
        info.get("flashfix"))


def gather(children):
    """Wait for ``children`` in order; their result rows, the last environment they reported, and
    one problem record per child that failed."""
    rows, env, problems = [], {}, []
    for c in children:
        c.wait()
        for result in c.results:
            env = result.get("env", env)
            if "row" in result:
                rows.append(result["row"])
        if c.failed():
            problems.append({"child": c.label, "rc": c.proc.returncode, "wall_s": c.wall_s, "tail": c.tail()})
    return rows, env, problems


# --- moved from flashfix/tools/gpu_checks.py (used by the benchmark scripts only) ---

def environment():
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import flashinfer

        info["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as exc:  # reported, the checks will fail on their own
        info["flashinfer"] = "import failed: %r" % (exc,)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["capability"] = "%d.%d" % (props.major, props.minor)
    else:
        info["gpu"] = None
    from flashfix import __version__

    info["flashfix"] = __version__
    return info


def time_ms(fn, warmup=3, iters=20):
    """Median time of ``fn()`` in milliseconds (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def sink_patch_state():
    """flashfix's state of the JIT-name patch in this process."""
    try:
        from flashfix.core import registry as _registry

        for row in _registry.status():
            if row["id"] == "flashinfer-sink-jit-name":
                return row["state"]
    except Exception as exc:
        return "status failed: %r" % (exc,)
    return "absent"


def markdown(rows, columns):
    """A markdown table of ``rows`` (dicts) with ``columns`` [(header, key or callable)]."""

    def cell(row, key):
        value = key(row) if callable(key) else row.get(key, "")
        if isinstance(value, float):
            if math.isinf(value):
                return "inf (NaN)"
            return "%.4g" % value
        return str(value)

    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, k) for _, k in columns) + " |")
    return "\n".join(lines)


def write_json(name, payload):
    """Write ``payload`` to ``$OUT/<name>`` when OUT is set; returns the path or None."""
    import json

    out = os.environ.get("OUT")
    if not out:
        return None
    path = os.path.join(out, name)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, default=repr)
    return path

