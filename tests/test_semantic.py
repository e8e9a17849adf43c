"""flashfix.semantic: the pattern matcher, and a declaration's probe, edit and derived shape on
real SGLang source (the 0.5.17 and 0.5.18 engine environments' installed files, read as text)."""

import ast
import copy
import difflib

import pytest

import engine_env  # noqa: E402
import this_checkout

this_checkout.flashfix()
from flashfix import semantic, sglang_patch, vllm_patch
from flashfix.core import registry as _registry
from flashfix.core import render as _render
from flashfix.core import source as _source  # noqa: E402
from flashfix.semantic import build, find, match, pattern  # noqa: E402


def bindings(pat, code):
    b, node = {}, ast.parse(code).body[0]
    ok = match(pattern(pat), node.value if isinstance(node, ast.Expr) else node, b)
    return ok, {k: semantic._text(v) for k, v in b.items()}


def test_metavariable_binds_one_expression_or_attribute_name():
    assert bindings("f($A, b)", "f(x.y[0] + 1, b)") == (True, {"A": "x.y[0] + 1"})
    assert bindings("$O.forward($X)", "self.w.forward(q)") == (True, {"O": "self.w", "X": "q"})
    assert bindings("layer.$K", "layer.k_scale_float") == (True, {"K": "k_scale_float"})
    assert bindings("f($A, b)", "f(a, c)")[0] is False
    assert bindings("f($A)", "f(a, b)")[0] is False  # no list metavariable: the count must agree
    assert bindings("f($A)", "f(*a)")[0] is False  # a splat is not an expression
    assert bindings("f($_, $_)", "f(a, b)") == (True, {})


def test_repeated_metavariable_must_be_structurally_equal():
    assert bindings("$X + $X", "a.b[1] + a.b[1]")[0] is True
    assert bindings("$X + $X", "a.b[1] + a.b[2]")[0] is False
    assert bindings("$X = $X", "a = a")[0] is True  # ctx (Store vs Load) is ignored


def test_list_metavariable_matches_zero_or_more_items():
    assert bindings("f($$$A, last)", "f(last)") == (True, {"A": ""})
    assert bindings("f($$$A, last)", "f(1, 2, last)") == (True, {"A": "1, 2"})
    assert bindings("f($$$A, last)", "f(1, 2)")[0] is False
    assert bindings("$$$A and g()", "x and y(1) and g()") == (True, {"A": "x, y(1)"})
    assert bindings("f($$$A, $$$A)", "f(1, 2, 1, 2)") == (True, {"A": "1, 2"})
    assert bindings("f($$$A, $$$A)", "f(1, 2, 3)")[0] is False
    stmt = pattern("if $C:\n    $$$BODY\n    return $R")
    node = ast.parse("if ok:\n    a()\n    b()\n    return 3").body[0]
    b = {}
    assert match(stmt, node, b) and semantic._text(b["BODY"]) == "a(), b()" and semantic._text(b["R"]) == "3"


def test_keywords_match_by_name_in_any_order():
    assert bindings("f(a=$A, b=$B)", "f(b=2, a=1)") == (True, {"A": "1", "B": "2"})
    assert bindings("f(a=$A)", "f(a=1, b=2)")[0] is False  # unnamed keywords need **$$$
    ok, b = bindings("f(a=$A, **$$$KW)", "f(c=3, a=1, b=2)")
    assert ok and b == {"A": "1", "KW": "c=3, b=2"}
    assert bindings("f(**$$$KW)", "f(**extra)")[0] is False  # what **kwargs holds cannot be told
    ok, b = bindings("f(a=$A, **$$$KW, **$$$SPLAT)", "f(a=1, b=2, **extra)")  # unless a second rest passes it on
    assert ok and b == {"A": "1", "KW": "b=2", "SPLAT": "**extra"}
    assert bindings("f(**$$$KW, **$$$SPLAT)", "f(b=2)") == (True, {"KW": "b=2", "SPLAT": ""})
    assert bindings("f(a=$A)", "f(b=1)")[0] is False


def test_build_substitutes_copies_of_the_bindings():
    node = ast.parse("f(q, kv, causal=True, sm_scale=s)").body[0].value
    b = {}
    assert match(pattern("f($Q, $KV, **$$$KW)"), node, b)
    b.update(K=ast.parse("layer.k").body[0].value, V=ast.parse("layer.v").body[0].value)
    new = build(pattern("f($Q, $KV, **$$$KW, k_scale=$K, v_scale=$V)"), b)
    assert ast.unparse(new) == "f(q, kv, causal=True, sm_scale=s, k_scale=layer.k, v_scale=layer.v)"
    assert new.args[0] is not node.args[0]


SOURCE = '''
class Backend:
    def extend(self, layer, q, kv):
        out = paged.forward(q, kv, causal=True, k_scale=layer.ks, v_scale=layer.vs)
        o2, s2 = paged.forward_return_lse(q, kv, causal=False)
        return out, o2

    def other(self):
        return 1
'''

RULE = dict(module="m", function="Backend.extend", before="paged.forward_return_lse($Q, $KV, **$$$KW)",
            after="paged.forward_return_lse($Q, $KV, **$$$KW, k_scale=$K, v_scale=$V)",
            where="paged.forward($$$_, k_scale=$K, v_scale=$V, **$$$_)")


def shape(text, **changes):
    rule = semantic.Rule(**dict(RULE, **changes))
    tree = ast.parse(text)
    return rule, rule.site(_source.find_def(tree, rule.function), tree)


def test_where_binds_what_after_uses():
    rule, ([(node, b)], s) = shape(SOURCE)
    assert s.kind == _registry.BUGGY and "line 5" in s.reason
    assert semantic._text(b["K"]) == "layer.ks" and semantic._text(b["V"]) == "layer.vs"
    func = _source.find_def(ast.parse(SOURCE), "Backend.extend")
    rule.edit(func, _source.marker("t:x"))
    assert "paged.forward_return_lse(q, kv, causal=False, k_scale=layer.ks, v_scale=layer.vs)" in ast.unparse(func)


def test_probe_verdicts_and_reasons():
    fixed = SOURCE.replace("causal=False)", "causal=False, v_scale=layer.vs, k_scale=layer.ks)")
    assert shape(fixed)[1][1].kind == _registry.FIXED
    half = SOURCE.replace("causal=False)", "causal=False, k_scale=layer.ks)")
    s = shape(half)[1][1]
    assert s.kind == _registry.UNKNOWN and "already passes k_scale" in s.reason, s
    no_where = SOURCE.replace("k_scale=layer.ks, v_scale=layer.vs", "")
    s = shape(no_where)[1][1]
    assert s.kind == _registry.UNKNOWN and "has 0 `paged.forward($$$_, k_scale=$K" in s.reason, s
    splat = SOURCE.replace("causal=False)", "**kw)")
    s = shape(splat)[1][1]
    assert s.kind == _registry.UNKNOWN and "the call paged.forward_return_lse at line 5" in s.reason, s
    s = shape(SOURCE, function="Backend.gone")[1][1]
    assert s.kind == _registry.ABSENT and "has no function Backend.gone" in s.reason
    twice = SOURCE.replace("        return out, o2", "        paged.forward_return_lse(q, kv)\n        return out, o2")
    s = shape(twice)[1][1]
    assert s.kind == _registry.UNKNOWN and "found 2 (lines 5, 6)" in s.reason, s
    s = shape(SOURCE, absent_unless_mentioned="never_here", before="g($X)", after="h($X)")[1][1]
    assert s.kind == _registry.ABSENT and "Backend has no never_here in this release" in s.reason, s


def test_declaration_without_delete_when_is_refused():
    with pytest.raises(ValueError, match="Delete when"):
        semantic.Backport(id="x", engine="e", versions=">=1", upstream="u", fixed_in="2", summary="s",
                          doc="Why: nothing", **{k: v for k, v in RULE.items()})


# --- real SGLang source ----------------------------------------------------------------------------


def installed(release, module, engine="sglang"):
    """The text of ``module`` as installed in that release's environment (built if missing)."""
    return engine_env.installed_path("%s==%s" % (engine, release), module.replace(".", "/") + ".py").read_text()


def probe(patch, text):
    try:
        return patch.probe({patch.targets[0]: _source.parse_text(text, "<test>")})
    finally:
        _source.forget()


def function_dump(patch, text):
    func = _source.find_def(ast.parse(text), patch.rule.hunks[0].function)
    return ast.dump(_render._strip_markers(copy.deepcopy(func)))


@pytest.mark.parametrize("patch", [sglang_patch.FP8_KV_SCALES, sglang_patch.VISION_CONFIG], ids=lambda p: p.id)
def test_derived_prefix_round_trip_on_real_source(patch):
    fixed = installed("0.5.18", patch.targets[0])
    assert probe(patch, fixed).kind == _registry.FIXED
    prefix = semantic.derive_prefix(patch, fixed)
    assert probe(patch, prefix).kind == _registry.BUGGY, probe(patch, prefix)
    changed = [i for i, (a, b) in enumerate(zip(fixed.splitlines(), prefix.splitlines())) if a != b]
    assert changed and len(changed) <= 3 or len(fixed.splitlines()) != len(prefix.splitlines())
    # before -> after on the derived shape, through the runtime's own edit and render: the release again
    func = _source.find_def(ast.parse(prefix), patch.rule.hunks[0].function)
    edited = copy.deepcopy(func)
    patch.rule.hunks[0].edit(edited, _source.marker("test:site"))
    rendered = _source.render_edit(prefix, func, edited)
    lines = prefix.splitlines(keepends=True)
    again = "".join(lines[:rendered.start - 1]) + rendered.text(rendered.PLAIN) + "".join(
        lines[rendered.start - 1 + len(rendered.before.splitlines()):])
    assert probe(patch, again).kind == _registry.FIXED
    assert function_dump(patch, again) == function_dump(patch, fixed)


@pytest.mark.parametrize("patch", [sglang_patch.FP8_KV_SCALES, sglang_patch.VISION_CONFIG], ids=lambda p: p.id)
def test_release_before_the_fix_is_the_pre_fix_shape(patch):
    text = installed("0.5.17", patch.targets[0])
    assert probe(patch, text).kind == _registry.BUGGY
    with pytest.raises(ValueError, match="expected one"):
        semantic.derive_prefix(patch, text)  # no fixed form to turn back


def test_several_statements_insert_a_line_and_turn_back():
    # an upstream change that adds a statement: before is one statement, after two (a Block)
    change = dict(before="out = paged.forward($$$A, **$$$KW)", where=None,
                  after="out = paged.forward($$$A, **$$$KW)\nout = out.float()")
    rule, (found, s) = shape(SOURCE, **change)
    assert s.kind == _registry.BUGGY and "line 4" in s.reason, s
    func = _source.find_def(ast.parse(SOURCE), "Backend.extend")
    rule.edit(func, _source.marker("t:x"))
    body = [ast.unparse(stmt) for stmt in func.body]
    assert body[:3] == ["__flashfix_mark__('t:x')",
                        "out = paged.forward(q, kv, causal=True, k_scale=layer.ks, v_scale=layer.vs)",
                        "out = out.float()"], body
    compile(ast.fix_missing_locations(ast.Module([func], [])), "t", "exec")
    fixed = SOURCE.replace("v_scale=layer.vs)\n", "v_scale=layer.vs)\n        out = out.float()\n", 1)
    assert shape(fixed, **change)[1][1].kind == _registry.FIXED
    patch = semantic.Backport(id="t", engine="e", versions=">=1", upstream="u", fixed_in="2", summary="s",
                              doc="Delete when: never", module="m", function="Backend.extend", **change)
    assert semantic.derive_prefix(patch, fixed) == SOURCE
    # the same statements twice in one block: refused, not guessed
    twice = SOURCE.replace("        o2, s2", "        out = paged.forward(q, kv)\n        o2, s2", 1)
    assert shape(twice, **change)[1][1].kind == _registry.UNKNOWN


def test_names_the_new_code_reads_must_resolve():
    # a lambda's parameter, a comprehension variable and an `except ... as` name are bound by the
    # function; a name bound nowhere is reported (the declaration refuses it unless the module has it)
    func = ast.parse("def f(self, xs):\n    try:\n        pass\n    except E as err:\n        pass\n").body[0]
    new = ast.parse("g(lambda v: v + 1, [y for y in xs], err, missing_helper)").body[0]
    func.body.append(new)
    assert semantic._free_names([new], func) == {"g", "missing_helper"}


TOPK = dict(module="vllm.v1.sample.ops.topk_topp_sampler", function="apply_top_k_top_p",
            before="return apply_top_k_top_p_pytorch($L, $K, $P)",
            after="is_cpu = current_platform.is_cpu()\nreturn apply_top_k_top_p_pytorch($L, $K, $P, allow_cpu_sync=is_cpu)")


def test_several_statements_on_real_vllm_source():
    # vLLM 0.30.0 turned the last statement of apply_top_k_top_p into two; 0.29.0 has the one
    patch = semantic.Backport(id="t-topk", engine="vllm", versions=">=0.29", upstream="u", fixed_in="0.30.0",
                              summary="s", doc="Delete when: never", **TOPK)
    old, new = (installed(v, TOPK["module"], "vllm") for v in ("0.29.0", "0.30.0"))
    assert probe(patch, new).kind == _registry.FIXED
    assert probe(patch, old).kind == _registry.BUGGY
    # the runtime's edit, rendered as the runtime compiles it: that one line becomes the two
    func = _source.find_def(ast.parse(old), TOPK["function"])
    edited = copy.deepcopy(func)
    patch.rule.hunks[0].edit(edited, _source.marker("t:x"))
    rendered = _source.render_edit(old, func, edited)
    before, after = rendered.before.splitlines(), rendered.text(_render.PLAIN).splitlines()
    assert [line for line in before if line not in after] == ["    return apply_top_k_top_p_pytorch(logits, k, p)"]
    assert [line for line in after if line not in before] == [
        "    is_cpu = current_platform.is_cpu()", "    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=is_cpu)"]
    # turned back, the fixed release's text is a pre-fix shape that the probe patches
    assert probe(patch, semantic.derive_prefix(patch, new)).kind == _registry.BUGGY


# --- the diff shows upstream's lines, in the engine's spelling (real SGLang 0.5.17 -> 0.5.18) -----

KDA = dict(module="sglang.srt.layers.attention.linear.kda_backend", function="KDAKernelDispatcher.__init__",
           before="if decode_backend.is_triton():\n    $$$T\nelse:\n    $$$E",
           after="if decode_backend.is_triton():\n    $$$T\nelif decode_backend.is_helion():\n"
                 "    assert helion_kernel is not None\n    self.decode_kernel = helion_kernel\nelse:\n    $$$E")


def changed_lines(patch, text):
    """``(removed, added, rendered)``: the installed lines the runtime's edit drops and the lines it
    adds, in the text the runtime compiles (and ``flashfix diff`` prints)."""
    func = _source.find_def(ast.parse(text), patch.rule.hunks[0].function)
    edited = copy.deepcopy(func)
    patch.rule.hunks[0].edit(edited, _source.marker("t:x"))
    rendered = _source.render_edit(text, func, edited)
    assert rendered.whole == ()
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(_render._strip_markers(copy.deepcopy(edited)))
    ops = difflib.SequenceMatcher(None, before := rendered.before.splitlines(),
                                  after := rendered.text(_render.PLAIN).splitlines(), autojunk=False).get_opcodes()
    return ([line for tag, i1, i2, _, _ in ops if tag != "equal" for line in before[i1:i2]],
            [line for tag, _, _, j1, j2 in ops if tag != "equal" for line in after[j1:j2]], rendered)


def test_the_diff_is_upstreams_lines_in_the_engines_spelling():
    """Before: an added ``elif`` became a shifted chain (every later branch rewritten, comments moved,
    strings requoted), ``"vision_config"`` became ``'vision_config'``, and a call spread over lines was
    written again whole."""
    patch = semantic.Backport(id="t-kda", engine="sglang", versions=">=0.5", upstream="u", fixed_in="0.5.18",
                              summary="s", doc="Delete when: never", **KDA)
    old, new = (installed(v, KDA["module"]) for v in ("0.5.17", "0.5.18"))
    removed, added, _ = changed_lines(patch, old)
    # the elif branch upstream added, line for line; the branch below it (with its comments) untouched
    anchor = new.splitlines().index("            self.decode_kernel = triton_kernel")
    assert removed == [] and added == new.splitlines()[anchor + 1:anchor + 4], added
    assert added[0] == "        elif decode_backend.is_helion():"
    # an argument added to a call spread over lines: one line each, as upstream has them
    text = installed("0.5.17", sglang_patch.FP8_KV_SCALES.targets[0])
    removed, added, _ = changed_lines(sglang_patch.FP8_KV_SCALES, text)
    assert removed == [] and added == ["                    k_scale=layer.k_scale_float,",
                                       "                    v_scale=layer.v_scale_float,"]
    # the engine's quotes and the comment above the statement stay; only the statement's lines change
    text = installed("0.5.17", sglang_patch.VISION_CONFIG.targets[0])
    removed, added, rendered = changed_lines(sglang_patch.VISION_CONFIG, text)
    assert removed == ["        self.is_image_understandable_model = enable_multimodal and hasattr(",
                       '            self.hf_config, "vision_config"', "        )"]
    assert added == ['        self.is_image_understandable_model = enable_multimodal and getattr(self.hf_config, '
                     '"vision_config", None) is not None']
    plain = rendered.text(_render.PLAIN).splitlines()
    assert plain[plain.index(added[0]) - 1] == "        # TODO: requires further polishing"


LAYOUTS = {  # each module binds to_ln, which the new code reads
    "old": "def to_ln(x):\n    return x\n\n\nclass Impl:\n    def _new_fi(self, q):\n        ret = run(q)\n        return ret[0], ret[1].transpose(0, 1)\n\n"
           "    def _ctx_fi(self, q):\n        out, lse = run(q)\n        return out, lse.transpose(0, 1)\n",
    "new": "def to_ln(x):\n    return x\n\n\nclass Backend:\n    def new_tokens(self, q):\n        ret = run(q)\n        return ret[0], ret[1].transpose(0, 1)\n\n"
           "    def context_chunk(self, q):\n        out, lse = run(q)\n        return out, lse.transpose(0, 1)\n",
}


def test_a_metavariable_in_a_store_and_a_load_position_builds_compilable_code():
    # `$L = f($L)`: the first match binds the assignment's target (a store); built into a load
    # position it must be a load, or the edited function does not compile (and cannot be rendered)
    patch = semantic.Backport(id="t-ctx", engine="e", versions=">=1", upstream="u", fixed_in="2", summary="s",
                              doc="Delete when: never", module="m", function="f", every=True,
                              before="$L = $L.transpose(0, 1)", after="$L = to_ln($L.transpose(0, 1))")
    old = "def f(a, b):\n    a = a.transpose(0, 1)\n    b = b.transpose(0, 1)\n    return a, b\n"
    func = _source.find_def(ast.parse(old), "f")
    edited = copy.deepcopy(func)
    patch.rule.hunks[0].edit(edited, _source.marker("t:x"))
    compile(ast.fix_missing_locations(ast.Module([edited], [])), "t", "exec")
    new = old.replace("a = a.transpose(0, 1)", "a = to_ln(a.transpose(0, 1))").replace(
        "b = b.transpose(0, 1)", "b = to_ln(b.transpose(0, 1))")
    assert semantic.derive_prefix(patch, new) == old  # every match turned back, each rendered in place


def test_sites_give_every_hunk_its_function_per_layout():
    # two hunks (two functions) that moved together between releases, renamed: one declaration
    rule = dict(before="return $O, $L", after="return $O, to_ln($L)", constraints={"L": r".*\.transpose\(0, 1\)"})
    hunks = (semantic.Rule("new", "Backend.new_tokens", **rule), semantic.Rule("new", "Backend.context_chunk", **rule))
    patch = semantic.Backport(id="t-lay", engine="e", versions=">=1", upstream="u", fixed_in="2", summary="s",
                              doc="Delete when: never", hunks=hunks,
                              sites=((("old", "Impl._new_fi"), ("old", "Impl._ctx_fi")),
                                     (("new", "Backend.new_tokens"), ("new", "Backend.context_chunk"))))
    for layout, text in LAYOUTS.items():
        trees = {"old": None, "new": None, layout: ast.parse(text)}
        shape, located, _ = patch.rule.shape(trees.get)
        assert shape.kind == _registry.BUGGY, (layout, shape)
        assert [(m, q) for _, m, q, _ in located] == list(patch.rule.layouts[layout == "new"])
        fixed = text.replace("ret[1].transpose(0, 1)", "to_ln(ret[1].transpose(0, 1))").replace(
            "lse.transpose(0, 1)", "to_ln(lse.transpose(0, 1))")
        assert patch.rule.shape(dict(trees, **{layout: ast.parse(fixed)}).get)[0].kind == _registry.FIXED
        derived = semantic.derive_prefix(patch, fixed)  # both hunks turned back (a tuple re-rendered in parentheses)
        assert ast.dump(ast.parse(derived)) == ast.dump(ast.parse(text)), derived


def test_a_scope_read_in_pieces_is_walked_only_where_it_spells_the_patterns_names(monkeypatch):
    """``find`` walks no function whose text lacks a name the pattern spells (not its metavariables),
    and a module whose names are not in NFKC form (read whole: its functions carry no text) is walked:
    ``self.w.\\uff46orward`` is ``self.w.forward`` to Python. Before the NFKC rule: no match found."""
    walked = []
    from flashfix.core import matcher

    real = matcher.walk
    monkeypatch.setattr(matcher, "walk", lambda node: walked.append(node) or real(node))
    p = pattern("$O.forward($X, **$$$KW)")
    text = "class A:\n    def f(self):\n        return self.w.forward(q, s=1)\n    def g(self):\n        return self.w(q)\n"
    f, g = (_source.find_def(_source.Module(text, "<t>"), q) for q in ("A.f", "A.g"))
    assert len(find(p, [f])) == 1 and find(p, [g]) == [] and g not in walked and f in walked
    plain = _source.find_def(ast.parse(text), "A.g")  # no text: walked
    assert find(p, [plain]) == [] and plain in walked
    spelled = _source.find_def(_source.Module(text.replace("w.forward", "w.\uff46orward"), "<t>"), "A.f")
    assert len(find(p, [spelled])) == 1


def test_the_matchers_walk_is_ast_walk():
    """``source.walk`` (the matcher's: no generator per node) gives ``ast.walk``'s nodes in its order."""
    for tree in (ast.parse(installed("0.5.17", "sglang.srt.layers.attention.flashinfer_backend")),
                 pattern("f($A, **$$$K)\nx.y = [1, 2]")):  # a Block of statements too
        assert [id(n) for n in _source.walk(tree)] == [id(n) for n in ast.walk(tree)]


@pytest.mark.parametrize("patch", [vllm_patch.DCP_PAGE_COUNTS, vllm_patch.DCP_LSE, vllm_patch.XQA_HEAD_DIM],
                         ids=lambda p: p.id)
def test_a_rewrite_copies_only_what_its_edit_replaces(patch):
    # the runtime's rewrite copies the def along the paths to the nodes the edit replaces
    # (_source.copy_paths) instead of deep-copying it: the edit must come out the same as on a deep
    # copy, the probe's tree must stay as read, and the rest must be shared, not copied
    rule = patch.rule.hunks[0]
    text = installed("0.28.0", rule.module, "vllm")
    func = _source.find_def(ast.parse(text), rule.function)
    as_read, deep = ast.dump(func), copy.deepcopy(func)
    rule.edit(deep, _source.marker("t:x"))
    shared = _source.copy_paths(func, rule.touches(func))
    rule.edit(shared, _source.marker("t:x"))
    assert ast.dump(shared) == ast.dump(deep) != as_read
    assert ast.dump(func) == as_read
    originals = {id(n) for n in ast.walk(func)}
    kept = sum(id(n) in originals for n in ast.walk(shared))
    assert kept > 0.8 * len(originals), (kept, len(originals))
    rendered = _source.render_edit(text, func, shared)
    assert ast.dump(rendered.tree(_render.PLAIN)) == ast.dump(_render._strip_markers(deep))
