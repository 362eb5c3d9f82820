"""The sizes of one `scripts/gpu-check` run: the GPU flow, the `--cpu` flow on the tiny
models, and the tests' `--quick` one; and what each stage needs of the budget."""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the GPU flow, the `--cpu` flow, or the test's `--quick` one."""

    device: str
    dtype: str  # the experiment's and step stage's dtype
    experiment_model: str  # "llama3-8b" (dummy weights) or a tiny preset
    input_len: int
    prefix_len: int
    output_len: int
    request_rate: float
    max_prompts: int
    min_prompts: int
    step_batches: str
    step_prompt_len: int
    step_steps: int
    profile_plans: int
    parity_prompts: int
    server_args: tuple[str, ...] = ()
    parity_model: str = "default"
    kv_prompts: int = 16  # the fp8 KV cache stage's agreement: prompts x greedy tokens
    kv_tokens: int = 64
    skip: tuple[str, ...] = ()  # stages this plan leaves out
    # The quantized stage's formats (bench/gpu_check/quantized.py), beside the plain dtype.
    quant_formats: tuple[str, ...] = ("ct-fp8", "fp8-block", "gptq")
    # `tandem bench spec`'s sizes (the speculation stage, bench/gpu_check/spec.py)
    spec_args: tuple[str, ...] = ("--preset", "fast")
    # `tandem bench stall`'s sweep (the stall stage, bench/gpu_check/stall.py): budgets per
    # step for the mixed arms (the CUDA default is 512), and each server's KV cache in GiB
    stall_args: tuple[str, ...] = ("--budgets", "256,512", "--rounds", "3")
    stall_kv_cache_memory: str = "4"
    # The arrivals stage (bench/gpu_check/arrivals.py): Poisson rate, prompts, runs per arm
    arrival_rate: float = 10.0
    arrival_prompts: int = 150
    arrival_repeats: int = 1


GPU_PLAN = Plan("cuda", "bfloat16", "llama3-8b", 1024, 512, 512, 10.0, 200, 20, "1,32,64",
                512, 32, 20, 4, ("--kv-cache-memory", "40", "--max-num-seqs", "128"))
CPU_PLAN = Plan("cpu", "float32", "default", 128, 64, 32, 8.0, 48, 8, "1,8,32", 128, 16, 10, 4,
                kv_prompts=8, kv_tokens=32,
                stall_args=("--in-process", "--budgets", "96,128,160,224", "--rounds", "3"),
                arrival_rate=0.75, arrival_prompts=24)
QUICK_PLAN = replace(CPU_PLAN, experiment_model="fast", input_len=32, prefix_len=16,
                     output_len=8, request_rate=50.0,
                     max_prompts=4, min_prompts=4, step_batches="1", step_prompt_len=16,
                     step_steps=8, profile_plans=3, parity_prompts=1, parity_model="fast",
                     kv_prompts=2, kv_tokens=16,
                     # spec: two more server starts (~45 s on 2 busy cores), stall: a
                     # minute of scenarios, arrivals and kv fp8: two and four servers
                     # (~35 s, ~26 s); each is checked with stand-ins (tests/bench/
                     # test_spec.py, test_stall.py, test_gpu_check.py) and runs in the
                     # --cpu flow.
                     skip=("gpu tests", "features", "spec", "stall", "arrivals", "kv fp8"),
                     quant_formats=("ct-fp8",),
                     spec_args=("--preset", "fast", "--modes", "async:8", "--workloads",
                                "copy", "--batches", "1", "--requests", "2", "--input-len",
                                "24", "--output-len", "8"))


# Rough seconds each stage needs at least, GPU and CPU; below that it is skipped and named.
NEEDS = {"environment": (5, 5), "gpu tests": (60, 30), "parity": (90, 40),
         "features": (60, 40), "experiment": (260, 75), "profile": (0, 0), "step": (60, 40),
         "quantized": (120, 40), "families": (90, 40), "kv fp8": (150, 50),
         "spec": (240, 60), "stall": (200, 300), "arrivals": (120, 90)}
