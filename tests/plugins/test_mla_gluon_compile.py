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


def _compile(ws: bool, o_ptr: str):
    """The plain or the warp-specialized kernel, launched with fp32 partials (several splits) or writing the bf16
    output in place (one): (SASS, resource usage, shared bytes)."""
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    fn = gluon_sm90.mla_decode_sm90_ws_kernel if ws else gluon_sm90.mla_decode_sm90_kernel
    warps = 4 if ws else gluon_sm90.WARPS
    lat, pe = gluon_sm90.page_descriptors(torch.zeros(4, 64, 576, dtype=torch.bfloat16), 512)
    ptrs = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", o_ptr=o_ptr, lse_ptr="*fp32")
    consts = dict(BH=gluon_sm90.BLOCK_H, PAGE=64, DL=512, DR=64, num_warps=warps)
    sig = {}
    for name in fn.arg_names:
        sig[name] = ("constexpr" if name in consts else mangle_type(lat) if name == "lat_desc" else
                     mangle_type(pe) if name == "pe_desc" else ptrs.get(name, "*i32") if name.endswith("_ptr") else
                     "fp32" if name == "qk_scale" else "i32")
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, {})
    options = dict(num_warps=warps, **(dict(maxnreg=gluon_sm90.WS_MAXNREG) if ws else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return (*sm90_sass(compiled.asm["cubin"]), compiled.metadata.shared)


@pytest.fixture(scope="module", params=["*fp32", "*bf16"], ids=["partials", "in_place"])
def sass(request):
    return _compile(False, request.param)


@pytest.fixture(scope="module", params=["*fp32", "*bf16"], ids=["partials", "in_place"])
def ws_sass(request):
    return _compile(True, request.param)


def test_fits_one_program_an_sm_without_spills(sass):
    code, usage, shared = sass
    assert int(re.search(r"REG:(\d+)", usage).group(1)) <= 255
    assert not re.findall(r"\b(?:STL|LDL)\b", code), "registers spill to local memory"
    # queries 72 KB + two page buffers 144 KB + scores 8 KB, within a block's limit
    assert 224 * 1024 <= shared <= H100_SHARED


def test_each_warpgroup_computes_its_half_of_the_scores(sass):
    """Per page and warpgroup: the scores [64 heads, 32 of the 64 tokens] over K = 576 (36 MMAs of k 16), the
    values [64, 256 of 512 columns] over the page's 64 tokens (4); Triton's kernel without the exchange took 72
    score MMAs of the same shape (both warpgroups all 64 tokens)."""
    mmas = Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass[0]))
    assert mmas == {"64x32x16": 36, "64x256x16": 4}


def test_pages_arrive_by_tma(sass):
    code = sass[0]
    # the first page's copy and the loop's: latent [64, 512] and rope [64, 64] each (the latent as 64-column boxes)
    assert len(re.findall(r"\bUTMALDG\b", code)) == 4
    assert "SYNCS.PHASECHK.TRANS64" in code  # the mbarrier wait on a page's bytes


def test_warp_specialized_kernel_fits_and_splits_its_roles(ws_sass):
    """The warp-specialized form: one program an SM without spills; the scores warpgroup computes each page's
    scores whole (36 MMAs of 64x64x16: no duplicate, no row statistic crossing warpgroups) and each warpgroup its
    half of the values (4 of 64x256x16 each); registers moved to the warpgroups that do the math (setmaxnreg: 256
    for the scores', 192 for the values', 24 for the loader's)."""
    code, usage, shared = ws_sass
    assert "LOCAL:0" in usage and not re.findall(r"\b(?:STL|LDL)\b", code), "registers spill to local memory"
    assert shared <= H100_SHARED
    assert Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", code)) == {"64x64x16": 36, "64x256x16": 8}
    regs = {int(r, 16) for r in re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP0, (0x[0-9a-f]+)", code)}
    assert {256, gluon_sm90.WS_VALUES_REGS.value} <= regs, regs
    assert "SYNCS.PHASECHK.TRANS64" in code  # mbarrier waits (pages, scores ready / free)
