"""The sm_90 Gluon MLA decode kernel compiled on the CPU (Triton ships ptxas and cuobjdump): what its design rests on,
read from its SASS. Not compiled for gfx942: it is Hopper-only by design (TMA, wgmma); ROCm runs the Triton kernel
(test_rocm_compile)."""
import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from k3plugins.mla import gluon_sm90  # noqa: E402
from test_rocm_compile import sm90_sass  # noqa: E402

H100_SHARED = 232448  # bytes of shared memory a block may have on sm_90


def _compile(fn, heads: int, o_ptr: str, lean: bool = gluon_sm90.LEAN_SOFTMAX):
    """(SASS, resource usage, shared bytes) of a kernel of `heads` heads a program for sm_90."""
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    lat, pe = gluon_sm90.page_descriptors(torch.zeros(4, 64, 576, dtype=torch.bfloat16), 512)
    ptrs = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", o_ptr=o_ptr, lse_ptr="*fp32")
    consts = dict(BH=heads, PAGE=64, DL=512, DR=64, LEAN=lean, num_warps=4)
    sig = {}
    for name in fn.arg_names:
        sig[name] = ("constexpr" if name in consts else mangle_type(lat) if name == "lat_desc" else
                     mangle_type(pe) if name == "pe_desc" else ptrs.get(name, "*i32") if name.endswith("_ptr") else
                     "fp32" if name == "qk_scale" else "i32")
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, {})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, maxnreg=gluon_sm90.MAXNREG))
    return (*sm90_sass(compiled.asm["cubin"]), compiled.metadata.shared)


@pytest.fixture(scope="module", params=["*fp32", "*bf16"], ids=["partials", "in_place"])
def sass(request):
    """The kernel launched with fp32 partials (several splits) and writing the bf16 output in place (one)."""
    return _compile(gluon_sm90.mla_decode_sm90_kernel, gluon_sm90.BLOCK_H, request.param)


def test_fits_one_program_an_sm_without_spills(sass):
    code, usage, shared = sass
    assert "LOCAL:0" in usage and not re.findall(r"\b(?:STL|LDL)\b", code), "registers spill to local memory"
    # queries 72 KB + two page buffers 144 KB + scores 8 KB + the rescale factors, row sums and barriers
    assert 224 * 1024 <= shared <= H100_SHARED


def test_the_scores_warpgroup_computes_each_pages_scores_once(sass):
    """The scores warpgroup: each page's scores [64 heads, 64 tokens] whole over K = 576 (36 MMAs of k 16: no
    duplicate, no row statistic crossing warpgroups); each warpgroup its half of the values [64, 256 of 512
    columns] over the page's 64 tokens (4 each). The form before split each dot's N instead (36 x 64x32x16 + 4 x
    64x256x16 a warpgroup, both in turn); Triton's kernel without the exchange took 72 score MMAs."""
    assert Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass[0])) == {"64x64x16": 36, "64x256x16": 8}


def test_registers_go_to_the_warpgroups_that_do_the_math(sass):
    """setmaxnreg moves the loader warp's warpgroup down to 24 registers and the others up: 256 for the scores
    warpgroup (its scores, P and half the output accumulate in registers), VALUES_REGS for the values one."""
    code = sass[0]
    regs = {int(r, 16) for r in re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP0, (0x[0-9a-f]+)", code)}
    assert {256, gluon_sm90.VALUES_REGS.value} <= regs, regs
    assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x18\b", code)  # the loader's 24


def test_pages_arrive_by_tma(sass):
    code = sass[0]
    assert re.findall(r"\bUTMALDG\b", code)  # the loader's copies: latent (in 64-column boxes) and rope
    assert "SYNCS.PHASECHK.TRANS64" in code  # the mbarrier waits (a page's bytes, P ready / free)


def test_narrow_remainder_kernel_puts_the_heads_on_n():
    """The last head block's 32 heads (NARROW_REMAINDER) on the MMA's N: 36 score MMAs of 64 tokens x 32 heads x 16
    and 2 x 16 value MMAs of 64 columns x 32 heads x 16 (V^T and P^T read transposed from shared memory, no copy
    through registers), against 36 + 8 MMAs of twice the work for a padded 64-row block; no spills. The same kernel
    holds the 64-row blocks' body (one launch), its shared memory placed once: the larger body's, not the sum."""
    code, usage, shared = _compile(gluon_sm90.mla_decode_sm90_narrow_kernel, gluon_sm90.NARROW, "*bf16")
    assert "LOCAL:0" in usage and not re.findall(r"\b(?:STL|LDL)\b", code), "registers spill to local memory"
    assert shared <= H100_SHARED
    assert Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", code)) == {"64x32x16": 68, "64x64x16": 36, "64x256x16": 8}
    assert len(re.findall(r"HGMMA\.64x32x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB", code)) == 32
    assert not re.findall(r"\bLDSM\b", code)



def test_lean_softmax_keeps_the_mmas_and_drops_the_scale_multiplies():
    """LEAN_SOFTMAX against the softmax before it (masked on every page, scaled by multiplies of its own): the same
    MMAs, no spills, and the scores' scale inside the exponent's FFMA (fewer FMULs: 32 a page of 64 x 64 scores a
    thread's 32) with the mask's selects behind a branch taken on the last page only."""
    code, usage, _ = _compile(gluon_sm90.mla_decode_sm90_kernel, gluon_sm90.BLOCK_H, "*bf16", lean=True)
    before = _compile(gluon_sm90.mla_decode_sm90_kernel, gluon_sm90.BLOCK_H, "*bf16", lean=False)[0]
    assert "LOCAL:0" in usage and not re.findall(r"\b(?:STL|LDL)\b", code), "registers spill to local memory"
    assert Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", code)) == Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", before))
    fmul = lambda c: len(re.findall(r"\bFMUL\b", c))  # noqa: E731
    assert fmul(code) <= fmul(before) - 30


def test_page_descriptors_are_built_once_a_cache_tensor_and_go_with_it():
    """page_descriptors keeps its answer by cache tensor: the same objects again (no host work a launch), over the
    cache's own storage (rope columns dl elements in), rebuilt when the tensor's storage changes, and dropped (not
    keeping the cache alive) when the tensor goes."""
    kv = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    lat, pe = gluon_sm90.page_descriptors(kv, 512)
    again = gluon_sm90.page_descriptors(kv, 512)
    assert again[0] is lat and again[1] is pe
    assert lat.base.data_ptr() == kv.data_ptr() and pe.base.data_ptr() == kv.data_ptr() + 512 * kv.element_size()
    assert list(lat.shape) == [8 * 64, 512] and list(pe.shape) == [8 * 64, 64]
    kv.set_(torch.zeros_like(kv).untyped_storage(), 0, kv.shape, kv.stride())  # the same tensor, new storage
    moved = gluon_sm90.page_descriptors(kv, 512)[0]
    assert moved is not lat and moved.base.data_ptr() == kv.data_ptr()
    key = id(kv)
    assert key in gluon_sm90._DESCRIPTORS
    del kv
    assert key not in gluon_sm90._DESCRIPTORS
