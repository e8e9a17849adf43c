"""_distinfo reads a version from METADATA only where that gives what importlib.metadata gives."""

import sys
from importlib import metadata

from flashfix import _distinfo, _locate


def _expected(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_every_installed_distribution_reads_as_importlib_metadata_reads_it():
    names = {"surely-not-installed", "packaging", "PACKAGING", "Packaging"}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            names |= {name, name.upper(), name.replace("-", "_"), name.replace("-", "."), name.replace("_", "-")}
    sure = 0
    for name in sorted(names):
        got = _distinfo.version(name)
        if got is not _distinfo.UNSURE:
            sure += 1
            assert got == _expected(name), name
        assert _locate.ImportSystem().version(name) == _expected(name), name
    assert sure >= len(names) // 2


def _dist(root, folder, metadata_text):
    (root / folder).mkdir(parents=True)
    if metadata_text is not None:
        (root / folder / "METADATA").write_text(metadata_text)


def test_unusual_layouts_are_left_to_importlib_metadata(tmp_path, monkeypatch):
    _dist(tmp_path, "plain_dist-1.0.dist-info", "Metadata-Version: 2.1\nName: plain-dist\nVersion: 1.0\n\nbody\n")
    _dist(tmp_path, "Odd__Name-2.0.dist-info", "Metadata-Version: 2.1\nName: odd-name\nVersion: 2.0\n")
    _dist(tmp_path, "folded-3.0.dist-info", "Metadata-Version: 2.1\nName: folded\nVersion: 3.0\n  .post1\n")
    _dist(tmp_path, "nometa-4.0.dist-info", None)
    _dist(tmp_path, "eggy-5.0.egg-info", None)
    (tmp_path / "eggy-5.0.egg-info" / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: eggy\nVersion: 5.0\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    assert _distinfo.version("plain-dist") == "1.0" == _expected("plain-dist")
    assert _distinfo.version("Plain.Dist") == "1.0"
    for name in ("odd-name", "folded", "nometa", "eggy"):
        assert _distinfo.version(name) is _distinfo.UNSURE, name
        assert _locate.ImportSystem().version(name) == _expected(name), name
    zipped = tmp_path / "archive.zip"
    zipped.write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(zipped)] + sys.path)
    assert _distinfo.version("plain-dist") is _distinfo.UNSURE


def test_another_distribution_finder_is_left_to_importlib_metadata(monkeypatch):
    class Finder:
        @staticmethod
        def find_spec(*args):
            return None

        @staticmethod
        def find_distributions(context=None):
            return iter(())

    monkeypatch.setattr(sys, "meta_path", [Finder()] + sys.meta_path)
    assert _distinfo.version("packaging") is _distinfo.UNSURE
