"""Version ranges of the patch declarations, checked without importing ``packaging``.

``packaging.specifiers`` costs the doctor more than all the reading it does (it imports its
tag and platform machinery), for ranges such as ``>=0.5.1`` or ``>=0.2.9,<0.7.4``. This module
parses PEP 440 versions and evaluates the comparison clauses ``==``, ``!=``, ``<=``, ``>=``,
``<`` and ``>`` (no wildcards) as ``SpecifierSet(spec, prereleases=True)`` of packaging 26
does, exclusive ordered comparisons included (``<V`` admits no pre-release of V unless V is
one, ``>V`` no post-release or local version of V). Older packaging releases read ``<V`` and
``>V`` of a post- or dev-release V differently; the patches declare no such clause. Any other
clause answers ``UNSUPPORTED``, and the caller asks ``packaging``. ``tests/test_versions.py``
compares the two on every release of the engines.
"""

import re

UNSUPPORTED = object()

_VERSION = re.compile(
    r"""^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?:-(?P<post_n1>[0-9]+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?)?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_CLAUSE = re.compile(r"^\s*(==|!=|<=|>=|<|>)\s*([^\s*]+)\s*$")


class _Version:
    __slots__ = ("epoch", "release", "pre", "post", "dev", "local")

    def __init__(self, text):
        m = _VERSION.match(text)
        if m is None:
            raise ValueError("not a PEP 440 version: %r" % (text,))
        self.epoch = int(m.group("epoch") or 0)
        release = [int(part) for part in m.group("release").split(".")]
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        self.release = tuple(release)
        self.pre = (_PRE_RANK[m.group("pre_l").lower()], int(m.group("pre_n") or 0)) if m.group("pre_l") else None
        post = m.group("post_n1") or m.group("post_n2")
        self.post = int(post or 0) if (m.group("post_n1") or m.group("post_l")) else None
        self.dev = int(m.group("dev_n") or 0) if m.group("dev_l") else None
        local = m.group("local")
        self.local = tuple((1, int(p)) if p.isdigit() else (0, p.lower())
                           for p in re.split(r"[-_.]", local)) if local else None

    def key(self, with_local=True, **replace):
        """The sort key (PEP 440 order); ``replace`` gives other values for some fields."""
        f = dict(pre=self.pre, post=self.post, dev=self.dev, local=self.local if with_local else None)
        f.update(replace)
        if f["pre"] is None and f["post"] is None and f["dev"] is not None:
            pre = (-1, 0)  # 1.0.dev0 sorts before 1.0a0
        else:
            pre = f["pre"] if f["pre"] is not None else (3, 0)
        post = -1 if f["post"] is None else f["post"]
        dev = float("inf") if f["dev"] is None else f["dev"]
        local = (0,) if f["local"] is None else (1, f["local"])
        return self.epoch, self.release, pre, post, dev, local

    def prerelease(self):
        return self.pre is not None or self.dev is not None


def _matches(op, spec, v):
    """One clause, as the version intervals of PEP 440 (and packaging 26) define it."""
    if op in ("==", "!="):  # ==V admits V's local versions unless V has a local part itself
        equal = v.key(with_local=spec.local is not None) == spec.key()
        return equal if op == "==" else not equal
    if op == ">=":
        return v.key() >= spec.key()
    if op == "<=":
        return v.key(with_local=False) <= spec.key()
    if op == "<":  # no pre-release of V unless V is one: below V.dev0
        return v.key() < (spec.key() if spec.prerelease() else spec.key(dev=0, local=None))
    # ">": above V and everything of V's own: its local versions and its post-releases
    if spec.dev is not None:
        return v.key() >= spec.key(dev=spec.dev + 1, local=None)
    if spec.post is not None:
        return v.key() >= spec.key(post=spec.post + 1, dev=0, local=None)
    return v.key() > spec.key() and (v.epoch, v.release, v.pre) != (spec.epoch, spec.release, spec.pre)


def contains(spec, version):
    """True or False: ``version`` is in ``spec`` (pre-releases admitted); ``ValueError`` for a
    version that is not PEP 440; ``UNSUPPORTED`` for a clause this module does not evaluate."""
    clauses = []
    for clause in spec.split(","):
        m = _CLAUSE.match(clause)
        if m is None:
            return UNSUPPORTED
        try:
            bound = _Version(m.group(2))
        except ValueError:
            return UNSUPPORTED
        if bound.local is not None and m.group(1) not in ("==", "!="):
            return UNSUPPORTED
        clauses.append((m.group(1), bound))
    v = _Version(version)
    return all(_matches(op, bound, v) for op, bound in clauses)
