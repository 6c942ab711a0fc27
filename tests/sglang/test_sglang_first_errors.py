"""A call to a patched launcher with one or two faults is refused for the fault sglang's own
launcher names first: the same exception type and sglang's text word for word (the patch may
add a fix after a ``;``), and the call changes nothing. Faults that sglang lets through and the
patch refuses, or the other way round, are documented differences and left out here: int32
scatter offsets, strided ``flat_in`` or pool columns, a verify scratch of ``bs + 1`` (sglang
wants 4 097). A faulty SWA LUT is refused for the same fault, but named by the launcher's
keyword, ``full_to_swa_index_mapping``, where sglang's texts name its internal ``lut_tensor``
and ``lut_len`` (``_LUT_WORDING``)."""

from __future__ import annotations

import pytest
import torch
from _sglang_cases import make_plan_case, make_scatter_case, offsets_outputs

from kvcanary_dispatch.integrations import sglang as integration

pytest_plugins = ["_sglang_fixtures"]  # the kv fixture, and a clean patch state per test


def _pairs(faults: dict) -> list[tuple[str, ...]]:
    names = list(faults)
    return [(a,) for a in names] + [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]


def _refusal(fn, kw: dict) -> tuple[type, str]:
    with pytest.raises(Exception) as err:
        fn(**kw)
    return err.type, str(err.value)


def _check_first_error(
    upstream, patched_binding, call: dict, faults: tuple, table: dict, wording: tuple = ()
):
    """``wording``: (sglang's words, the patch's) pairs, read into sglang's text."""
    for fault in faults:
        call = {**call, **table[fault](call)}
    want_type, want = _refusal(upstream, call)
    for theirs, ours in wording:
        want = want.replace(theirs, ours)
    kept = {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}
    with integration.applied():
        binding = patched_binding()
        assert any(binding is new for *_, new in integration.patched_attributes()), binding
        got_type, got = _refusal(binding, call)
    assert issubclass(got_type, want_type), (got_type, want_type, got)
    assert got == want or got.startswith(want + ";"), (got, want)
    for name, before in kept.items():
        assert torch.equal(call[name], before), f"a refused call changed {name}"


# One fault each, as a change to a valid call's keywords.
_SCATTER_FAULTS = {
    "flat_in 2-D": lambda k: {"flat_in": k["flat_in"].view(1, -1)},
    "flat_in float32": lambda k: {"flat_in": k["flat_in"].float()},
    "offsets 2-D": lambda k: {"offsets": k["offsets"].view(1, -1)},
    "offsets float32": lambda k: {"offsets": k["offsets"].float()},
    "offsets int16": lambda k: {"offsets": k["offsets"].to(torch.int16)},
    "offsets short": lambda k: {"offsets": k["offsets"][:-1]},
    "req_pool_indices 2-D": lambda k: {"req_pool_indices": k["req_pool_indices"].view(1, -1)},
    "req_pool_indices int32": lambda k: {"req_pool_indices": k["req_pool_indices"].int()},
    "pool_out 1-D": lambda k: {"pool_out": k["pool_out"][0]},
    "pool_out int64": lambda k: {"pool_out": k["pool_out"].long()},
}


@pytest.mark.parametrize("faults", _pairs(_SCATTER_FAULTS), ids=" + ".join)
def test_scatter_refuses_for_sglangs_first_error(kv, faults):
    call = vars(make_scatter_case(6, seed=3))
    binding = lambda: kv.expected_mgr.launch_scatter_req_token_ids_kernel  # noqa: E731
    _check_first_error(
        kv.scatter.launch_scatter_req_token_ids_kernel, binding, call, faults, _SCATTER_FAULTS
    )


def _strided(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t, t], 1)[:, 0]


_OFFSETS_FAULTS = {
    "req_pool_indices int32": lambda k: {"req_pool_indices": k["req_pool_indices"].int()},
    "prefix_lens float": lambda k: {"prefix_lens": k["prefix_lens"].double()},
    "extend_seq_lens strided": lambda k: {"extend_seq_lens": _strided(k["extend_seq_lens"])},
    "verify_capacity -1": lambda k: {"verify_capacity": -1},
    "verify_capacity -1.5": lambda k: {"verify_capacity": -1.5},
    "out_write_offsets empty": lambda k: {"out_write_offsets": k["out_write_offsets"][:0]},
    "out_write_offsets short": lambda k: {"out_write_offsets": k["out_write_offsets"][:-1]},
    "bs over capacity": lambda k: {
        "out_write_offsets": k["out_write_offsets"][:-1],
        "out_write_seed_slot_indices": k["out_write_seed_slot_indices"][:-1],
    },
    "prefix_lens short": lambda k: {"prefix_lens": k["prefix_lens"][:-1]},
    "extend_seq_lens 2-D": lambda k: {"extend_seq_lens": k["extend_seq_lens"].view(1, -1)},
    "req_to_token 1-D": lambda k: {"req_to_token": k["req_to_token"][0]},
    "out_verify_num_valid of 2": lambda k: {"out_verify_num_valid": torch.zeros(2).int()},
    "out_verify_enable 2-D": lambda k: {"out_verify_enable": k["out_verify_enable"].view(1, 1)},
}


@pytest.mark.parametrize("faults", _pairs(_OFFSETS_FAULTS), ids=" + ".join)
def test_offsets_launcher_refuses_for_sglangs_first_error(kv, faults):
    case = make_plan_case(40, seed=5)
    call = {}  # a valid call's keywords, as offsets_outputs makes them
    scalars = lambda total: {"swa_window_size": 0, "verify_capacity": total + 3}  # noqa: E731
    offsets_outputs(lambda **kw: call.update(kw), case, scalars)
    binding = lambda: kv.api.launch_plan_offsets_kernel  # noqa: E731
    upstream = kv.offsets.launch_plan_offsets_kernel
    _check_first_error(upstream, binding, call, faults, _OFFSETS_FAULTS)


_LUT = torch.arange(64)
_LUT_FAULTS = {
    "lut int32": lambda k: {"full_to_swa_index_mapping": _LUT.int()},
    "lut 2-D": lambda k: {"full_to_swa_index_mapping": _LUT.view(1, -1)},
    "lut strided": lambda k: {"full_to_swa_index_mapping": _strided(_LUT)},
    "lut empty": lambda k: {"full_to_swa_index_mapping": _LUT[:0]},
}
_LUT_WORDING = (
    (
        "lut_len must be positive when has_swa_lut is True",
        "full_to_swa_index_mapping length must be >= 1, got 0",
    ),
    ("lut_tensor", "full_to_swa_index_mapping"),
)


@pytest.mark.parametrize(
    "faults",
    [(lut,) for lut in _LUT_FAULTS] + [(lut, o) for lut in _LUT_FAULTS for o in _OFFSETS_FAULTS],
    ids=" + ".join,
)
def test_offsets_launcher_refuses_a_faulty_lut_for_sglangs_first_error(kv, faults):
    """A faulty LUT, alone or with another fault: sglang's type and first fault, its text with
    the LUT named as the caller passed it (a window of 3, so that the LUT applies)."""
    case = make_plan_case(40, seed=5)
    call = {}
    scalars = lambda total: {"swa_window_size": 3, "verify_capacity": total + 3}  # noqa: E731
    offsets_outputs(lambda **kw: call.update(kw), case, scalars)
    call["full_to_swa_index_mapping"] = _LUT
    binding = lambda: kv.api.launch_plan_offsets_kernel  # noqa: E731
    upstream = kv.offsets.launch_plan_offsets_kernel
    table = {**_LUT_FAULTS, **_OFFSETS_FAULTS}
    _check_first_error(upstream, binding, call, faults, table, _LUT_WORDING)


_WINDOW_FAULTS = {  # windows sglang's launcher reads with int() only when it launches
    "window None": lambda k: {"swa_window_size": None},
    "window NaN": lambda k: {"swa_window_size": float("nan")},
    "window inf": lambda k: {"swa_window_size": float("inf")},
}
_BEFORE_SCALARS = ("req_pool_indices int32", "prefix_lens float", "extend_seq_lens strided")


@pytest.mark.parametrize(
    "faults", [(w, o) for w in _WINDOW_FAULTS for o in _BEFORE_SCALARS], ids=" + ".join
)
def test_offsets_launcher_refuses_a_tensor_fault_before_a_malformed_window(kv, faults):
    """A window ``int()`` refuses, with a tensor's contiguity or dtype fault: sglang's type and
    text for the tensor (sglang reads the window after its checks, the patch among its
    scalars, after the tensors' contiguity and dtypes)."""
    case = make_plan_case(40, seed=5)
    call = {}
    scalars = lambda total: {"swa_window_size": 0, "verify_capacity": total + 3}  # noqa: E731
    offsets_outputs(lambda **kw: call.update(kw), case, scalars)
    binding = lambda: kv.api.launch_plan_offsets_kernel  # noqa: E731
    upstream = kv.offsets.launch_plan_offsets_kernel
    table = {**_WINDOW_FAULTS, **_OFFSETS_FAULTS}
    _check_first_error(upstream, binding, call, faults, table)


@pytest.mark.parametrize("fault", sorted(_WINDOW_FAULTS))
def test_offsets_launcher_names_a_malformed_window(kv, fault):
    """Alone, such a window is a ``TypeError`` naming ``swa_window_size`` and the fix (sglang's
    is ``int()``'s own error, naming nothing), and the call changes nothing."""
    case = make_plan_case(40, seed=5)
    call = {}
    scalars = lambda total: {"swa_window_size": 0, "verify_capacity": total + 3}  # noqa: E731
    offsets_outputs(lambda **kw: call.update(kw), case, scalars)
    call.update(_WINDOW_FAULTS[fault](call))
    kept = {k: v.clone() for k, v in call.items() if isinstance(v, torch.Tensor)}
    value = call["swa_window_size"]
    text = (
        f"kv-canary: swa_window_size must be an int, got {value!r} ({type(value).__name__}); "
        "pass a non-negative int (0 for no window)"
    )
    with integration.applied(), pytest.raises(TypeError) as err:
        kv.api.launch_plan_offsets_kernel(**call)
    assert str(err.value) == text
    for name, before in kept.items():
        assert torch.equal(call[name], before), f"a refused call changed {name}"
