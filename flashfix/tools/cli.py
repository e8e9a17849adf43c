"""``flashfix`` command line: ``doctor``, ``diff``, ``verify`` and ``prepare``."""

import argparse
import contextlib
import sys


def _add_sources(parser):
    """``--path`` / ``--python``: ``sources``, ``(kind, value)`` in command-line order (earlier
    wins, as on sys.path)."""
    parser.set_defaults(sources=[])
    parser.add_argument("--path", dest="sources", action="append", type=lambda value: ("path", value), metavar="PATH",
                        help="read the engines from PATH instead of this environment: a wheel (read from the zip, "
                             "not installed), a site-packages folder or a source tree; repeat to read several as one "
                             "environment (e.g. an SGLang wheel and a FlashInfer wheel; beside an engine, a dependency wheel "
                             "that a fix requires, to judge it as installed)")
    parser.add_argument("--python", dest="sources", action="append", type=lambda value: ("python", value), metavar="EXE",
                        help="read the environment of the interpreter EXE: runs EXE (its start-up, .pth files "
                             "included) on a small standard-library program that says where modules and "
                             "distributions are; no engine is imported there")
    parser.add_argument("--run-packs", action="store_true", help="with --path/--python: import the patch packs "
                        "found there, EXECUTING their code here, to judge them (else they are named, not run)")


def open_sources(sources, stack):
    """The reader for ``--path``/``--python`` values (None: this interpreter); the interpreters asked are
    closed with ``stack`` (an ``ExitStack``). SourceError (with its message) when one cannot be read."""
    from flashfix.tools import doctor as _doctor
    from flashfix.core import paths as _paths

    readers, refused = [], []
    for kind, value in sources:
        if kind == "python":
            from flashfix.tools import remote as _remote

            readers.append(stack.enter_context(_remote.PythonReader(value)))
        else:
            readers.append(_paths.open_path(value))
            try:
                _doctor.check_holds_an_engine(readers[-1], value)
            except _paths.SourceError as exc:  # a dependency (a wheel a fix ``requires``), read beside an engine
                refused.append(exc)
    if refused and len(refused) == len(readers):  # no engine among them: nothing to judge
        raise refused[0]
    return (readers[0] if len(readers) == 1 else _paths.Composite(readers)) if readers else None


def main(argv=None):
    import flashfix

    parser = argparse.ArgumentParser(prog="flashfix", description="Backported FlashInfer-backend fixes for vLLM and SGLang.")
    parser.add_argument("--version", action="version", version="flashfix %s" % flashfix.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="say, without importing any engine, what flashfix would do in this environment")
    doctor.add_argument("--json", action="store_true", help="print a JSON list, one object per patch")
    doctor.add_argument("--strict", action="store_true", help="exit 1 when an affected engine has an unknown shape")
    _add_sources(doctor)
    diff = sub.add_parser("diff", help="show, without importing any engine, the engine code as installed against the "
                                       "code flashfix runs once it applies")
    diff.add_argument("ids", nargs="*", metavar="ID", help="patch ids (default: every patch)")
    diff.add_argument("--marker", action="store_true",
                      help="show the rewritten code as it is until its first run, with the one-time marker line")
    diff.add_argument("--series", action="store_true",
                      help="then, for each function that several of the patches shown rewrite, the installed code "
                           "against the code the whole series runs")
    _add_sources(diff)
    verify = sub.add_parser("verify", help="on this GPU: check that the fixes are in force and numerically right "
                                           "(exit 0 pass, 1 fail, 2 bad --path or --only, 3 no GPU, "
                                           "4 no engine)")
    verify.add_argument("--json", action="store_true", help="print a JSON report on stdout (progress goes to stderr)")
    verify.add_argument("--path", dest="paths", action="append", default=[], metavar="PATH",
                        help="also check the engine in PATH (a wheel or source tree, not installed here): its patched "
                             "module is loaded with stand-ins for the engine modules it imports")
    verify.add_argument("--only", type=lambda s: s.split(","), default=(), metavar="ID[,ID]",
                        help="run the numeric checks of these patch ids only")
    sub.add_parser("prepare", help="store the decision of every patch for the engines installed here, so that engine "
                                   "processes reuse it instead of reading their source again (an image build step, "
                                   "as compileall is); where: FLASHFIX_CACHE_DIR")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return _prepare()
    from flashfix.core import locate as _locate

    try:
        if args.command == "verify":
            from flashfix.tools.verify import run

            return run(as_json=args.json, paths=args.paths, only=args.only)
        with contextlib.ExitStack() as stack:
            reader = open_sources(args.sources, stack)
            if reader is not None:
                reader.run_packs = args.run_packs
            if args.command == "doctor":
                from flashfix.tools import doctor as _doctor

                return _doctor.run(as_json=args.json, strict=args.strict, reader=reader)
            from flashfix.tools import diff as _diff

            return _diff.run(args.ids, reader=reader, marker=args.marker, whole_series=args.series)
    except _locate.SourceError as exc:
        sys.stderr.write("flashfix %s: %s\n" % (args.command, exc))
        return 2


def _prepare():
    import os

    from flashfix.core import decisions as _decisions
    from flashfix.core import registry as _registry

    folder = _decisions.directory()
    if folder is None:
        sys.stderr.write("flashfix prepare: FLASHFIX_CACHE_DIR=%s turns the decision cache off\n" % os.environ["FLASHFIX_CACHE_DIR"])
        return 2
    done = _registry.prepare_decisions()
    for pid, what in done:
        print("%-48s %s" % (pid, what))
    stored = sum(1 for _, what in done if not what.startswith("not stored"))
    print("%d of %d decisions stored in %s" % (stored, len(done), folder))
    if any("cannot be written" in what for _, what in done):
        sys.stderr.write("flashfix prepare: %s cannot be written: run it as who installs flashfix, or set "
                         "FLASHFIX_CACHE_DIR to a folder engine processes can read\n" % folder)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
