"""`module:function` resolution for reward functions."""

from __future__ import annotations

import pytest

from refill.rewards.loader import ImportObjectError, load_reward_fn, split_spec

FIXTURES = "tests.unit.config.sampler_fixtures"


def test_loads_the_arith_reward() -> None:
    fn = load_reward_fn("refill.rewards.arith:exact_match")
    assert fn(" 7\n", {"answer": "7"}) == 1.0


def test_binds_kwargs() -> None:
    fn = load_reward_fn(f"{FIXTURES}:reward_ok", {"scale": 3.0})
    assert fn("x", {}) == 3.0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", "empty"),
        ("justaname", "module:name"),
        ("mod:", "module:name"),
        ("no_such_module_xyz:f", "cannot be found"),
        ("refill.rewards.arith:nope", "has no attribute"),
        (f"{FIXTURES}:reward_not_callable", "not a function"),
        ("tests.unit.config.broken_module:f", "RuntimeError: boom at import"),
    ],
)
def test_bad_names_say_what_failed(spec: str, expected: str) -> None:
    with pytest.raises(ImportObjectError) as caught:
        load_reward_fn(spec)
    assert expected in caught.value.message
    assert caught.value.fix


def test_missing_dependency_of_an_existing_module_is_named(tmp_path, monkeypatch) -> None:
    (tmp_path / "needs_dep_mod.py").write_text("import some_dependency_that_is_absent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportObjectError) as caught:
        load_reward_fn("needs_dep_mod:f")
    assert "some_dependency_that_is_absent" in caught.value.message
    assert "install" in caught.value.fix


def test_wrong_kwargs_fail_at_load() -> None:
    with pytest.raises(ImportObjectError) as caught:
        load_reward_fn(f"{FIXTURES}:reward_ok", {"scael": 1.0})
    assert "reward.kwargs" in caught.value.fix


def test_split_spec_accepts_dotted_form() -> None:
    assert split_spec("pkg.mod:fn") == ("pkg.mod", "fn")
    assert split_spec("pkg.mod.fn") == ("pkg.mod", "fn")
