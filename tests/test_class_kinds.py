"""A class-body hunk on a class whose body is read once when the class is made (a dataclass, a NamedTuple, a
pydantic model, an attrs class, an enum) cannot change it: setting the new default on the class leaves a dataclass's
generated ``__init__`` with the old one, replaces a NamedTuple's field accessor, an enum's member... Before: a
dataclass default said ``applied`` with no effect, a ``field(default_factory=...)`` ``not-affected`` (strict mode
passed), a NamedTuple field made every instance read the new default, a pydantic field was ``patch`` for the doctor
and something else at run time. Now the doctor and the runtime both say ``unknown-shape``, naming the class kind, the
engine is untouched, and strict mode fails the import; a plain class's attribute is still backported. A fake engine
(tests/conftest.py) with a declarative pack; the doctor runs as ``python -m flashfix doctor --json`` does."""

import importlib.util
import json
import sys

import pytest
from conftest import IMPORT_ORDERS as ORDERS, run_py
from conftest import fake_doctor_row as doctor

PACK = '''
from flashfix.semantic import Backport

PATCHES = (Backport(
    id="fake-compute", engine="fakeeng", versions="<2", fixed_in="2.0", upstream="https://example.invalid/pr/1",
    module="fakeeng.core", function="Config", before=%r, after=%r,
    summary="a new default", doc="Why: a test. Delete when: never."),)
'''

# The fake pydantic: what the real one does to a model's body (the defaults move into ``model_fields``, the
# class attributes are gone); detected by its base's name, as a real pydantic model's ``BaseModel`` is.
FAKE_PYDANTIC = '''
class FieldInfo:
    def __init__(self, default=None, **limits):
        self.default, self.limits = default, limits

def Field(default=None, **limits):
    return FieldInfo(default, **limits)

class BaseModel:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.model_fields = {k: v for k, v in list(vars(cls).items()) if not k.startswith("_") and not callable(v)}
        for k in cls.model_fields:
            delattr(cls, k)

    def __init__(self, **values):
        for k, v in type(self).model_fields.items():
            setattr(self, k, values.get(k, v.default if isinstance(v, FieldInfo) else v))
'''

# kind: (engine source, before, after, what the reason names, the value read unpatched, patched)
KINDS = {
    "dataclass-default": ('''
from dataclasses import dataclass

@dataclass
class Config:
    page_size: int = 1

def read():
    return Config().page_size
''', "page_size: int = 1", "page_size: int = 16", "Config is a dataclass", 1),
    "dataclass-default-factory": ('''
import dataclasses

@dataclasses.dataclass(frozen=True)
class Config:
    sizes: list = dataclasses.field(default_factory=list)

def read():
    return Config().sizes
''', "sizes: list = dataclasses.field(default_factory=list)",
        "sizes: list = dataclasses.field(default_factory=lambda: [16])", "Config is a dataclass", []),
    "namedtuple": ('''
import typing

class Config(typing.NamedTuple):
    page_size: int = 1

def read():
    return Config().page_size, Config(5).page_size
''', "page_size: int = 1", "page_size: int = 16", "Config is a NamedTuple", [1, 5]),
    "pydantic": ((FAKE_PYDANTIC if importlib.util.find_spec("pydantic") is None else "from pydantic import BaseModel, Field\n")
                 + '''
class Config(BaseModel):
    priority: int = 0

def read():
    return Config().priority
''', "priority: int = 0", "priority: int = Field(default=0, ge=-10, le=10)", "Config is a pydantic model", 0),
    "enum": ('''
import enum

class Config(enum.Enum):
    SMALL = 1
    LARGE = 2

def read():
    return Config.SMALL.value, [m.name for m in Config]
''', "SMALL = 1", "SMALL = 16", "Config is an enum", [1, ["SMALL", "LARGE"]]),
    "attrs": ('''
import attrs

@attrs.define
class Config:
    page_size: int = 1

def read():
    return Config().page_size
''', "page_size: int = 1", "page_size: int = 16", "Config is an attrs class", 1),
    "dataclass-subclass": ('''
from dataclasses import dataclass

@dataclass
class Base:
    page_size: int = 1

class Config(Base):
    page_size: int = 1

def read():
    return Config().page_size
''', "page_size: int = 1", "page_size: int = 16", "Config is a dataclass", 1),
}

PLAIN = {
    "plain": ('''
class Config:
    page_size = 1

def read():
    return Config().page_size
''', "page_size = 1", "page_size = 16"),
    # a dataclass's class attribute that is not a field (no annotation, or a ClassVar): nothing made from it
    "dataclass-class-attribute": ('''
import typing
from dataclasses import dataclass

@dataclass
class Config:
    size: int = 1
    page_size = 1
    limit: typing.ClassVar[int] = 1

def read():
    return Config().page_size + Config.limit
''', "page_size = 1", "page_size = 15"),
}


RUN = '''
import flashfix
error = None
try:
    %s
except flashfix.PatchError as exc:
    error = str(exc)
core = sys.modules.get("fakeeng.core")  # a failed import (strict mode) leaves none
report(state=state()["state"], reason=state()["reason"], error=error, value=core and core.read())
'''


def runtime(site, order, strict=False):
    (r,), _ = run_py(RUN % ORDERS[order].replace("\n", "\n    "), site,
                     env={"FLASHFIX_STRICT": "1"} if strict else None)
    return json.loads(json.dumps(r))  # tuples as lists


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_class_body_hunk_on_a_class_made_from_its_body_is_refused_by_the_doctor_and_at_run_time(fake_site, kind):
    source, before, after, named, old = KINDS[kind]
    site = fake_site(engine_source=source, patches=PACK % (before, after))
    code, row = doctor(site, strict=True)
    assert (row["verdict"], code) == ("unknown-shape", 1), row
    assert named in row["reason"] and "class-body hunk cannot change" in row["reason"], row
    for order in sorted(ORDERS):
        r = runtime(site, order)
        assert (r["state"], r["reason"], r["error"]) == ("unknown-shape", row["reason"], None), (order, r)
        assert r["value"] == old, (order, r)  # the class untouched: instances read the old default
        r = runtime(site, order, strict=True)
        assert r["state"] == "unknown-shape" and r["error"] and named in r["error"], (order, r)


def test_a_class_the_source_does_not_show_as_a_dataclass_is_refused_at_run_time(fake_site):
    """The dataclass base lives in another module: the source of the class body alone cannot tell, the imported
    class can (its ``__dataclass_fields__``)."""
    base = '''
from dataclasses import dataclass

@dataclass
class Base:
    page_size: int = 1
'''
    source = '''
from fakeeng.base import Base

class Config(Base):
    page_size: int = 1

def read():
    return Config().page_size
'''
    site = fake_site(engine_source=source, patches=PACK % ("page_size: int = 1", "page_size: int = 16"),
                     extra={"fakeeng/base.py": base})
    for order in sorted(ORDERS):
        r = runtime(site, order)
        assert r["state"] == "unknown-shape" and "Config is a dataclass" in r["reason"], (order, r)
        assert r["value"] == 1, (order, r)
        r = runtime(site, order, strict=True)
        assert r["state"] == "unknown-shape" and r["error"] and "Config is a dataclass" in r["error"], (order, r)


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_a_plain_class_attribute_is_still_backported(fake_site, kind):
    source, before, after = PLAIN[kind]
    site = fake_site(engine_source=source, patches=PACK % (before, after))
    code, row = doctor(site, strict=True)
    assert (row["verdict"], code) == ("patch", 0), row
    for order in sorted(ORDERS):
        r = runtime(site, order, strict=True)
        assert (r["state"], r["error"], r["value"]) == ("applied", None, 16), (order, r)
