"""The shaders against the registry, their other source of truth.

The backend packs each op's push constants from the registry (OpDef.push), while the shader reads
them through its own ``layout(push_constant)`` block: nothing but this file checks that the two
agree, member by member, in name, type and order, for every op. Op codes likewise have one source,
the registry's tables (registry.OP_CODES), from which the compiler generates ``op_codes.glsl``:
these tests check that no shader defines a code itself or compares a code field with a number.

Push blocks are read from the preprocessed shader (``compiler.preprocess``: the real
glslangValidator preprocessor, so includes, the generated header and macros resolve exactly as
when compiling). The checks are plain functions, and ``test_the_checks_catch_a_mismatch`` feeds
them broken sources, so a check that could never fail would show.
"""

from __future__ import annotations

import re
from functools import cache

import pytest

from shaders import compiler, registry
from shaders.compiler import SHADER_DIR

GLSL_TYPES = {"uint": "u", "int": "i", "float": "f"}
_PUSH_BLOCK = re.compile(
    r"layout\s*\(\s*push_constant\s*\)\s*uniform\s+\w+\s*\{(?P<body>[^}]*)\}\s*(?P<instance>\w+)\s*;"
)
_MEMBER = re.compile(r"^(?P<type>\w+)\s+(?P<name>\w+)$")
_DEFINE = re.compile(r"^#define\s+(?P<name>\w+)\s+(?P<value>\d+)u$", re.MULTILINE)
# Names with these prefixes are op codes, and only the generated header may define them.
_CODE_NAME = re.compile(rf"\b(?:{'|'.join(registry.OP_CODES)})_[A-Z0-9_]+\b")
# Push fields that carry an op code (unary/binary/reduce's fn, cast's mode, an epilogue's act and
# act_grad), and the activation functions' code parameter. Whatever such a value is tested
# against must be a generated name: a number, or a constant of the shader's own, would be a code
# spelled outside the registry. So must every case label (shaders switch only on codes).
CODE_FIELDS = ("fn", "mode", "act", "act_grad")
_CODE_VALUE = rf"(?:\bpc\.(?:{'|'.join(CODE_FIELDS)})|\bcode)\b"
_CODE_TEST = re.compile(
    rf"{_CODE_VALUE}\s*(?:==|!=)\s*(\w+)|(\w+)\s*(?:==|!=)\s*{_CODE_VALUE}|\bcase\s+(\w+)"
)
# Codes are names, not quantities: an ordered comparison assumes a numbering the registry may change.
_CODE_ORDER = re.compile(rf"{_CODE_VALUE}\s*(?:<|>)|(?:<|>)=?\s*{_CODE_VALUE}")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def hand_written() -> list:
    """Every GLSL file in shaders/ (the generated header is never among them)."""
    return sorted([*SHADER_DIR.glob("*.comp"), *SHADER_DIR.glob("*.glsl")])


@cache
def preprocessed(shader: str) -> str:
    return compiler.preprocess(shader)


def push_members(source: str) -> tuple[str, list[tuple[str, str]]]:
    """(instance name, [(member name, registry kind)]) of the one push block in ``source``.

    Raises:
        AssertionError: when there is not exactly one block, or a member is not a plain 32-bit
            scalar (the registry packs 4 bytes per field).
    """
    blocks = list(_PUSH_BLOCK.finditer(source))
    assert len(blocks) == 1, f"expected one push_constant block, found {len(blocks)}"
    members = []
    for declaration in blocks[0]["body"].split(";"):
        declaration = " ".join(declaration.split())
        if not declaration:
            continue
        match = _MEMBER.match(declaration)
        assert match and match["type"] in GLSL_TYPES, f"push member {declaration!r} is not a 32-bit scalar"
        members.append((match["name"], GLSL_TYPES[match["type"]]))
    return blocks[0]["instance"], members


def push_problems(source: str, op: registry.OpDef) -> list[str]:
    """How the push block in ``source`` differs from ``op``'s registry entry (empty: it matches)."""
    instance, members = push_members(source)
    problems = []
    if instance != "pc":
        problems.append(f"{op.shader}: the push block is named {instance!r}, not 'pc'")
    if members != list(op.push):
        problems.append(f"{op.shader}: push block {members}; the registry's {op.name} packs {list(op.push)}")
    return problems


def code_problems(name: str, source: str, generated: set[str]) -> list[str]:
    """Op codes in a hand-written file that do not come from the generated header."""
    code = _COMMENT.sub("", source)
    problems = [
        f"{name} defines op code {m[1]}"
        for m in re.finditer(r"#\s*define\s+(\w+)", code)
        if _CODE_NAME.fullmatch(m[1])
    ]
    problems += [
        f"{name} declares op code {m[1]}"
        for m in re.finditer(r"\bconst\s+\w+\s+(\w+)\s*=", code)
        if _CODE_NAME.fullmatch(m[1])
    ]
    problems += [
        f"{name} uses {m[0]}, which the registry does not generate"
        for m in _CODE_NAME.finditer(code)
        if m[0] not in generated
    ]
    problems += [
        f"{name} tests an op code against {m[0]!r}, not a generated name"
        for m in _CODE_TEST.finditer(code)
        if next(operand for operand in m.groups() if operand) not in generated
    ]
    problems += [f"{name} orders op codes: {m[0]!r}" for m in _CODE_ORDER.finditer(code)]
    return problems


def generated_codes() -> dict[str, int]:
    return {m["name"]: int(m["value"]) for m in _DEFINE.finditer(compiler.op_codes_glsl())}


def test_every_shader_file_belongs_to_an_op():
    # A shader no op names would escape the push-block check below.
    assert {path.name for path in SHADER_DIR.glob("*.comp")} == {op.shader for op in registry.OPS.values()}


@pytest.mark.parametrize("name", sorted(registry.OPS))
def test_push_block_matches_the_registry(name):
    op = registry.op(name)
    problems = push_problems(preprocessed(op.shader), op)
    assert not problems, "\n".join(problems)


def test_generated_header_holds_every_registry_code_and_nothing_else():
    expected = {
        f"{prefix}_{name.upper()}": code
        for prefix, table in registry.OP_CODES.items()
        for name, code in table.items()
        if name is not None
    }
    assert generated_codes() == expected
    # The header skips ACTIVATIONS' None key, which is right only while it means "none".
    assert registry.ACTIVATIONS[None] == registry.ACTIVATIONS["none"]


def test_op_codes_come_only_from_the_generated_header():
    # A hand-written op_codes.glsl beside the shaders would shadow the generated one (an include
    # resolves beside the including file first).
    assert not (SHADER_DIR / "op_codes.glsl").exists()
    # A code field renamed in the registry would leave the number check below looking at nothing.
    pushed = {field for op in registry.OPS.values() for field, _ in op.push}
    assert set(CODE_FIELDS) <= pushed
    generated = set(generated_codes())
    problems = [p for path in hand_written() for p in code_problems(path.name, path.read_text(), generated)]
    assert not problems, "\n".join(problems)


def test_a_code_changed_in_the_registry_reaches_the_compiled_shader(tmp_path, monkeypatch):
    monkeypatch.setenv("VKFLOW_CACHE", str(tmp_path))
    before = compiler.compile_shader("binary.comp")
    monkeypatch.setitem(registry.OP_CODES, "BINARY", {"add": 1, "sub": 0, "mul": 2})
    assert "#define BINARY_ADD 1u" in compiler.op_codes_glsl()
    assert "if (pc.fn == 1u) {\n            z = x + y;" in compiler.preprocess("binary.comp")
    after = compiler.compile_shader("binary.comp")
    # A new cache key, so a new file, and different code: nothing stale was reused.
    assert len(list((tmp_path / "spirv").glob("binary-*.spv"))) == 2
    assert after != before


def test_the_checks_catch_a_mismatch():
    unary = registry.op("unary")
    source = preprocessed("unary.comp")
    assert push_problems(source, unary) == []
    # Two members swapped, a type changed, a member dropped, the block renamed: each is reported.
    swapped = source.replace("float a;\n    float b;", "float b;\n    float a;")
    assert swapped != source
    assert push_problems(swapped, unary)
    assert push_problems(source.replace("uint fn;", "int fn;"), unary)
    assert push_problems(source.replace("float b;", ""), unary)
    assert push_problems(re.sub(r"\}\s*pc\s*;", "} p;", source), unary)
    with pytest.raises(AssertionError, match="not a 32-bit scalar"):
        push_members(source.replace("uint n;", "uvec2 n;"))
    generated = set(generated_codes())
    assert code_problems("x.comp", "#define BINARY_ADD 0u\n", generated)
    assert code_problems("x.comp", "const uint ACT_RELU = 1u;\n", generated)
    assert code_problems("x.comp", "if (pc.fn == BINARY_DIV) {}\n", generated)
    assert code_problems("x.comp", "if (pc.fn == 2u) {}\n", generated)
    assert code_problems("x.comp", "switch (code) { case 3u: break; }\n", generated)
    assert code_problems("x.comp", "const uint FN_EXP = 8u;\nif (pc.fn == FN_EXP) {}\n", generated)
    assert code_problems("x.comp", "if (ACT_RELU != code) {}\n", generated) == []
    assert code_problems("x.comp", "if (pc.fn > REDUCE_MAX) {}\n", generated)
    prose = "// pc.fn == 2u in a comment is prose\nif (pc.fn == BINARY_ADD) {}\n"
    assert code_problems("x.comp", prose, generated) == []
