"""The kernel contract by name (fused_is/backends/abi.py, mirrored by csrc/fused_is_math.h): every kernel agrees with
the declaration, and a disagreement is an error when the extension loads, not wrong numbers."""

import types

import pytest
import torch

from fused_is import backends
from fused_is.backends import abi


def test_cpu_extension_reports_the_declared_contract():
    if backends.unavailable_reason("cpu", torch.empty(1, 1)) is not None:
        pytest.skip("the CPU extension is not built here (`fused-is build cpu`)")
    from fused_is.backends import cpp

    assert cpp.extension("cpu").abi() == abi.declaration()


@pytest.mark.parametrize("key", ["int_params", "float_params", "row_inputs"])
def test_a_reordered_contract_is_refused(key):
    reported = abi.declaration()
    reported[key] = reported[key][1:] + reported[key][:1]
    fake = types.SimpleNamespace(abi=lambda: reported)
    with pytest.raises(ImportError, match=f"its {key} are"):
        abi.check_extension(fake, "a test extension")


def test_a_renumbered_enum_is_refused():
    reported = abi.declaration()
    reported["enums"]["is_mode"]["mask"], reported["enums"]["is_mode"]["reject"] = 2, 1
    with pytest.raises(ImportError, match="its enums are"):
        abi.check_extension(types.SimpleNamespace(abi=lambda: reported), "a test extension")


def test_triton_kernel_takes_the_contract_by_name():
    if backends.unavailable_reason("triton", torch.empty(1, 1)) is not None:
        pytest.skip("triton is not importable here")
    from fused_is.backends.triton import kernels

    names = kernels()._fused_kernel.arg_names
    for name in abi.FLOAT_PARAMS:
        assert name in names, name
    for name in abi.INT_PARAMS:
        assert name.upper() in names, name.upper()


def test_pack_fills_rows_by_name():
    """pack() puts each input in the row its name says (a reordering of ROW_INPUTS moves the data with it)."""
    from fused_is.call import prepare_batch

    logits = torch.randn(4, 10)
    adv, samp, old, ref = torch.randn(4), -torch.rand(4), -torch.rand(4), -torch.rand(4)
    batch = prepare_batch(logits, torch.arange(4), adv, sampler_logprobs=samp, old_logprobs=old, ref_logprobs=ref,
                          config="ppo_tis")
    args = abi.pack(batch)
    row = dict(zip(abi.ROW_INPUTS, args.row_table))
    torch.testing.assert_close(row["adv"], adv.double())
    torch.testing.assert_close(row["base"], old.double())  # ratio_ref="old" with old_logprobs given
    torch.testing.assert_close(row["samp"], samp.double())
    torch.testing.assert_close(row["ref"], ref.double())
    assert args.ints["base_source"] == abi.ENUMS["base_source"]["vector"]
    assert args.ints["is_mode"] == abi.ENUMS["is_mode"]["truncate"]
    assert args.int_list() == [args.ints[k] for k in abi.INT_PARAMS]
