"""The one-token step's newer Triton kernels compile for a GPU (sm_90), here on a CPU: Triton's interpreter, which the
other tests run them through, accepts code that its compiler refuses (a loop-carried value that changes type, for
one), so a kernel can pass every CPU test and fail on its first GPU launch."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


def compile_for_gpu(fn, signature: dict, constexprs: dict) -> None:
    """fn compiled to a cubin for an sm_90 GPU (no GPU needed; Triton's own ptxas)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm.get("cubin")


def kernels():
    from sluice.kernels.add import _add3_kernel
    from sluice.kernels.attention import _one_query_kernel
    from sluice.kernels.down import _ordered_sum_kernel, _weigh_parts_kernel
    from sluice.kernels.kv_append import _append_kernel
    from sluice.kernels.gemv import _gemv_kernel
    from sluice.kernels.embed import _gather_kernel
    from sluice.kernels.host_wait import _wait_kernel
    from sluice.kernels.mamba import _gate_norm_kernel
    from sluice.kernels.norm import _rms_norm_kernel
    from sluice.kernels.rope import _norm_rope_kernel
    from sluice.kernels.router import _scores_kernel, _select_kernel, _softmax_select_kernel

    parts = {"part": "*fp32", "w": "*fp32", "y": "*fp32", "live": "*i32", "live_total": "*i64", "Dx": "i32", "A": "i32"}
    wait = {"flag": "*i64", "want": "*i64", "gave_up": "*i32", "limit": "i32", "pause": "i32"}
    return {
        "weigh_parts": (_weigh_parts_kernel, parts, dict(S=32, XDT=tl.bfloat16, YDT=tl.float32, SUM=False, BD=32, BL=64)),
        "weigh_parts summed": (_weigh_parts_kernel, {**parts, "y": "*bf16"},
                               dict(S=32, XDT=tl.bfloat16, YDT=tl.float32, SUM=True, BD=32, BL=64)),
        "gemv": (_gemv_kernel, {"x": "*bf16", "w": "*bf16", "b": "*bf16", "r": "*bf16", "y": "*bf16", "N": "i32", "K": "i32",
                                "W_N": "i32"}, dict(HAS_B=True, RELU2=True, HAS_R=True, YDT=tl.bfloat16, BN=4, BK=512, GDC=False)),
        "gemv fp16": (_gemv_kernel, {"x": "*fp16", "w": "*fp16", "b": "*fp16", "r": "*fp16", "y": "*fp16", "N": "i32",
                                     "K": "i32", "W_N": "i32"},
                      dict(HAS_B=False, RELU2=False, HAS_R=False, YDT=tl.float16, BN=2, BK=256, GDC=False)),
        "gemv pdl": (_gemv_kernel, {"x": "*bf16", "w": "*bf16", "b": "*bf16", "r": "*bf16", "y": "*bf16", "N": "i32", "K": "i32",
                                    "W_N": "i32"}, dict(HAS_B=False, RELU2=False, HAS_R=False, YDT=tl.bfloat16, BN=4, BK=512,
                                                        GDC=True)),
        "rms_norm": (_rms_norm_kernel, {"x": "*bf16", "w": "*bf16", "y": "*bf16", "D": "i32", "eps": "fp32", "X_R": "i32",
                                        "Y_R": "i32"}, dict(B=4096, ROUND_FIRST=False)),
        "rms_norm round first": (_rms_norm_kernel, {"x": "*bf16", "w": "*fp32", "y": "*fp32", "D": "i32", "eps": "fp32",
                                                    "X_R": "i32", "Y_R": "i32"}, dict(B=2048, ROUND_FIRST=True)),
        "ordered sum": (_ordered_sum_kernel, {"y": "*bf16", "out": "*bf16", **{n: "i32" for n in ("D", "Y_T", "Y_K", "Y_D")}},
                        dict(K=8, BD=1024, DT=tl.bfloat16)),
        "norm rope": (_norm_rope_kernel, {**{n: "*bf16" for n in ("q", "k", "qw", "kw", "cs", "sn", "qo", "ko")}, "eps": "fp32",
                                          **{n: "i32" for n in ("Hq", "Q_T", "K_T", "C_T", "QO_T", "KO_T")}},
                       dict(D=128, BD=128, NORM=True, ROUND_FIRST=True, XT=tl.bfloat16, DT=tl.bfloat16)),
        "rope": (_norm_rope_kernel, {**{n: "*bf16" for n in ("q", "k", "qw", "kw", "cs", "sn", "qo", "ko")}, "eps": "fp32",
                                     **{n: "i32" for n in ("Hq", "Q_T", "K_T", "C_T", "QO_T", "KO_T")}},
                 dict(D=40, BD=64, NORM=False, ROUND_FIRST=False, XT=tl.bfloat16, DT=tl.bfloat16)),
        "router scores": (_scores_kernel, {"x": "*bf16", "w": "*fp32", "s": "*fp32", "D": "i32", "E": "i32", "X_T": "i32"},
                          dict(BE=1, BD=4096, SIGMOID=True)),
        "router logits": (_scores_kernel, {"x": "*bf16", "w": "*bf16", "s": "*bf16", "D": "i32", "E": "i32", "X_T": "i32"},
                          dict(BE=1, BD=2048, SIGMOID=False)),
        "softmax select": (_softmax_select_kernel, {"s": "*bf16", "weights": "*bf16", "ids": "*i64", "E": "i32"},
                           dict(K=8, NORM=True, BE=128)),
        "mamba gate norm": (_gate_norm_kernel, {"zx": "*bf16", "y": "*fp32", "nw": "*bf16", "out": "*bf16", "cs": "*bf16",
                                                **{n: "i32" for n in ("I", "CONV_DIM", "GS", "CS_C", "CS_K", "CPP")},
                                                "eps": "fp32", "ZX_B": "i32", "CS_B": "i32"},
                            dict(OUT_DT=tl.bfloat16, K=4, BG=512, BC=256, BK=4)),
        "router select": (_select_kernel, {"s": "*fp32", "bias": "*fp32", "weights": "*fp32", "ids": "*i64", "E": "i32",
                                           "scale": "fp32"}, dict(K=6, NORM=True, BE=128)),
        "add3": (_add3_kernel, {"r": "*bf16", "a": "*bf16", "b": "*bf16", "y": "*bf16", "N": "i32"},
                 dict(DT=tl.bfloat16, B=1024)),
        "kv append": (_append_kernel, {"keys": "*bf16", "values": "*bf16", "k": "*bf16", "v": "*bf16", "length": "*i64",
                                       **{n: "i32" for n in ("H", "S", "DK", "DV", "K_H", "V_H")}}, dict(BK=256, BV=256)),
        "one-query attention": (_one_query_kernel, {"q": "*bf16", "k": "*bf16", "v": "*bf16", "mask": "*i1", "o": "*bf16",
                                                    "W": "i32", "scale": "fp32",
                                                    **{n: "i32" for n in ("Q_H", "K_H", "K_S", "V_H", "V_S", "M_S")}},
                                dict(G=16, D=128, BD=128, BW=64, HAS_MASK=True, DT=tl.bfloat16)),
        "embed gather": (_gather_kernel, {"table": "*bf16", "ids": "*i64", "out": "*bf16", "V": "i32", "D": "i32"},
                         dict(B=1024)),
        "host wait": (_wait_kernel, wait, dict(PAUSE=False)),
        "host wait paused": (_wait_kernel, wait, dict(PAUSE=True)),  # its nanosleep: inline PTX, never run interpreted
    }


NAMES = ["weigh_parts", "weigh_parts summed", "gemv", "gemv fp16", "gemv pdl", "rms_norm", "rms_norm round first",
         "router scores", "router logits", "softmax select", "mamba gate norm", "router select", "add3", "kv append",
         "one-query attention", "norm rope", "rope", "ordered sum", "host wait", "host wait paused", "embed gather", "must fail"]


def must_fail():
    """A running count that starts as a Python int and becomes an int64 tensor in its loop: the interpreter runs it."""

    @triton.jit
    def count(live, total, N: tl.constexpr):
        n = 0
        for i in range(0, N, 16):
            n += tl.sum(tl.load(live + i + tl.arange(0, 16)).to(tl.int64), axis=0)
        tl.store(total, n)

    return count, {"live": "*i32", "total": "*i64"}, dict(N=64)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, str]:
    """Each kernel's outcome, compiled in a process of its own: this one runs Triton interpreted (conftest.py), and
    interpreted kernels cannot be compiled."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compiled afresh, wherever HOME is
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.split(": ", 1)[0] in NAMES)
    assert set(lines) == set(NAMES), out.stderr[-2000:]
    return lines


@pytest.mark.parametrize("name", NAMES[:-1])
def test_kernel_compiles_for_a_gpu(name, compiled):
    assert compiled[name] == "ok"


def test_a_kernel_the_interpreter_runs_but_the_compiler_refuses_is_caught(compiled):
    assert compiled["must fail"].startswith("CompilationError")


if __name__ == "__main__":
    made = {**kernels(), "must fail": must_fail()}
    for name in NAMES:
        try:
            compile_for_gpu(*made[name])
            print(f"{name}: ok", flush=True)
        except Exception as e:  # reported to the test, which names the kernel
            print(f"{name}: {type(e).__name__} {str(e).splitlines()[0] if str(e) else ''}", flush=True)
