"""Hardware catalogue: datasheet numbers and one-line errors on typos."""

import pytest

from pipewright.errors import PipewrightError
from pipewright.hardware import accelerator, accelerator_names, link, link_names


def test_datasheet_numbers():
    a100 = accelerator("a100-80gb")
    assert a100.peak("fp16") == a100.peak("bf16") == 312e12
    assert a100.memory_bytes == 81920 * 2**20 and a100.nvlink == "nvlink3"
    assert accelerator("h100-sxm").peak("fp8") == 1979e12
    assert accelerator("h200").memory_bytes == 143771 * 2**20  # nvidia-smi: 143771MiB
    assert accelerator("v100").peak("fp16") == 125e12
    assert link("ib-hdr").bandwidth == 25e9 and link("ib-ndr").bandwidth == 50e9
    assert link("nvlink3").bandwidth == 300e9
    assert link("hdr") == link("ib-hdr")
    loop = link("gloo-loopback")
    assert (loop.bandwidth, loop.latency) == (1.8e9, 2e-4)


def test_cpu_is_this_machine():
    cpu = accelerator("cpu")
    assert cpu.peak("fp32") == 90e9
    assert cpu.memory_bytes > 1e9


@pytest.mark.parametrize(
    ("call", "names"),
    [(lambda: accelerator("a100"), accelerator_names), (lambda: link("nvlink5"), link_names)],
)
def test_typo_lists_known_names(call, names):
    with pytest.raises(PipewrightError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    assert all(n in message for n in names())


def test_missing_dtype():
    with pytest.raises(PipewrightError, match="v100 has no bf16 peak; choose one of: fp32, fp16"):
        accelerator("v100").peak("bf16")
