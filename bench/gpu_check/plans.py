"""The sizes of one `scripts/gpu-check` run: the GPU flow, the `--cpu` flow on the tiny
models, and the tests' `--quick` one; the named flows (which stages, in which order); and
what each stage needs of the budget."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

# Every stage, in the full flow's order.
STAGES = ("environment", "gpu tests", "parity", "features", "probe", "experiment", "stall",
          "arrivals", "step", "quantized", "families", "kv fp8", "spec")

# The seed experiment's arms by name (`--experiment-arms`): K, async, a prefill phase.
EXPERIMENT_ARMS = {"sync-k1": (1, False, False), "sync-k8": (8, False, False),
                   "async-k8": (8, True, False), "async-k8-prefill-phase": (8, True, True)}


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
    # The seed experiment: prompts per arm (0: as many as the budget allows, between
    # min_prompts and max_prompts; either way the report says how many and why), its arms
    # (EXPERIMENT_ARMS' names), whether the async arm is profiled, and its servers' rows
    # (10 req/s of 1,024 in / 512 out keeps ~150 requests running: more than 128).
    experiment_prompts: int = 0
    experiment_arms: tuple[str, ...] = ("sync-k1", "sync-k8", "async-k8",
                                        "async-k8-prefill-phase")
    profile: bool = True
    experiment_max_num_seqs: int = 256
    # The experiment's and arrivals' KV cache: "free" sizes it from the device's free memory
    # (CUDA; `models.kv_cache_gib`), "" leaves the server's default, else GiB.
    kv_cache_memory: str = ""
    # The probe stage (`probe.py`): ms/step per attention backend, batch and context, on
    # the probe model ("llama3-8b": the 8B shape with Llama 3's 128,256-token vocabulary).
    probe_model: str = "llama3-8b"
    probe_batches: tuple[int, ...] = (1, 8, 32, 64, 128)
    probe_contexts: tuple[int, ...] = (1024, 4096)
    probe_steps: int = 16  # timed steps per cell (plans of 8), after one warm-up plan
    probe_backends: tuple[str, ...] = ()  # --attention-backend names; (): the device's
    # The quantized stage's formats (bench/gpu_check/checks/quantized.py), beside the plain dtype.
    quant_formats: tuple[str, ...] = ("ct-fp8", "fp8-block", "gptq")
    # `tandem bench spec`'s sizes (the speculation stage, bench/gpu_check/checks/spec.py)
    spec_args: tuple[str, ...] = ("--preset", "fast")
    # `tandem bench stall`'s sweep (the stall stage, bench/gpu_check/checks/stall.py): budgets per
    # step for the mixed arms (the CUDA default is 512), and each server's KV cache in GiB
    stall_args: tuple[str, ...] = ("--budgets", "256,512", "--rounds", "3")
    stall_kv_cache_memory: str = "4"
    # The arrivals stage (bench/gpu_check/checks/arrivals.py): Poisson rate, prompts, runs per arm
    arrival_rate: float = 10.0
    arrival_prompts: int = 150
    arrival_repeats: int = 1
    arrival_input_len: int = 1024
    arrival_output_len: int = 128
    # The gpu tests stage's pytest arguments beyond `-m 'gpu or triton'` and the files
    # that mark tests
    gpu_test_args: tuple[str, ...] = ()
    # Seconds a stage may take at most (beside the run's budget); past it the stage is
    # stopped, its processes ended, and it is reported as timed out.
    stage_caps: dict[str, float] = field(default_factory=dict)


GPU_PLAN = Plan("cuda", "bfloat16", "llama3-8b", 1024, 512, 512, 10.0, 200, 20, "1,32,64",
                512, 32, 20, 4, kv_cache_memory="free")
CPU_PLAN = Plan("cpu", "float32", "default", 64, 32, 16, 8.0, 8, 4, "1,8", 64, 8, 6, 2,
                kv_prompts=4, kv_tokens=16, probe_model="default", probe_batches=(1, 4),
                probe_contexts=(64, 128), probe_steps=40,
                stall_args=("--in-process", "--budgets", "128,256", "--rounds", "1",
                            "--streams", "2", "--prompts", "2", "--prompt-len", "256",
                            "--interval", "0.3"),
                spec_args=("--preset", "fast", "--modes", "async:8", "--workloads", "copy",
                           "--batches", "1", "--requests", "2", "--input-len", "24",
                           "--output-len", "8"),
                experiment_max_num_seqs=64, arrival_rate=4.0, arrival_prompts=6,
                arrival_input_len=128,
                arrival_output_len=16)
QUICK_PLAN = replace(CPU_PLAN, experiment_model="fast", input_len=32, prefix_len=16,
                     output_len=8, request_rate=50.0,
                     max_prompts=4, min_prompts=4, step_batches="1", step_prompt_len=16,
                     step_steps=8, profile_plans=3, parity_prompts=1, parity_model="fast",
                     kv_prompts=2, kv_tokens=16, probe_model="fast", probe_batches=(1,),
                     probe_contexts=(32,),
                     # spec: two more server starts (~45 s on 2 busy cores), stall: a
                     # minute of scenarios, arrivals and kv fp8: two and four servers
                     # (~35 s, ~26 s); each is checked with stand-ins (tests/bench/
                     # test_spec.py, test_stall.py, test_gpu_check.py) and runs in the
                     # --cpu flow.
                     skip=("gpu tests", "features", "spec", "stall", "arrivals", "kv fp8"),
                     quant_formats=("ct-fp8",),
                     # Each arm is a fresh server (~9 s): sync K=8 adds no path that sync
                     # K=1 (the sync loop, the ratios' base) and async K=8 (K=8 plans) do not
                     # drive; the --cpu flow runs all four.
                     experiment_arms=("sync-k1", "async-k8", "async-k8-prefill-phase"))


@dataclass(frozen=True)
class Flow:
    """A named list of stages with the plan changes they run under and a default budget."""

    stages: tuple[str, ...]
    budget_s: float
    changes: dict[str, object] = field(default_factory=dict)
    gpu_changes: dict[str, object] = field(default_factory=dict)  # on the GPU only

    def plan(self, base: Plan) -> Plan:
        changes = {**self.changes, **(self.gpu_changes if base.device == "cuda" else {})}
        return replace(base, **changes)  # type: ignore[arg-type]


FLOWS = {
    "full": Flow(STAGES, 480.0),
    # One GPU window (≤ 9 minutes, docs/DESIGN.md §11): what the device is needed for, the
    # most wanted first; each stage has a slice of the window (500 s of the 540, the rest
    # for ending a stage that overran), so one that runs long is stopped and the rest still
    # run.  The slices are estimates until a window has timed them (results.json keeps
    # every stage's seconds).
    "window": Flow(
        ("environment", "probe", "experiment", "stall", "gpu tests", "parity"), 540.0,
        changes={"experiment_arms": ("async-k8", "sync-k1"), "profile": False},
        gpu_changes={"experiment_prompts": 200,
                     "stall_args": ("--budgets", "256,512", "--rounds", "2"),
                     "stage_caps": {"environment": 10, "probe": 120, "experiment": 165,
                                    "stall": 120, "gpu tests": 40, "parity": 45}}),
}


def experiment_arm(name: str) -> tuple[int, bool, bool]:
    """(K, async, prefill phase) of an `--experiment-arms` name; ValueError naming the
    choices for any other."""
    if name not in EXPERIMENT_ARMS:
        raise ValueError(f"unknown experiment arm {name!r}; choose from "
                         f"{', '.join(EXPERIMENT_ARMS)}")
    return EXPERIMENT_ARMS[name]


# Rough seconds each stage needs at least, GPU and CPU; below that it is skipped and named.
NEEDS = {"environment": (5, 5), "gpu tests": (30, 10), "parity": (40, 15),
         "features": (60, 20), "probe": (60, 15), "experiment": (120, 30), "profile": (0, 0),
         "step": (60, 15), "quantized": (120, 20), "families": (90, 15), "kv fp8": (150, 25),
         "spec": (240, 25), "stall": (100, 15), "arrivals": (120, 25)}
