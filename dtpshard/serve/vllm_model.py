"""`DTPForCausalLM` for vLLM: a DTP student at tensor-parallel size L, built from vLLM's layers.

TP rank l is device l (docs/design.md §1): the student's weights are already permuted, so vLLM's
contiguous TP shards (QKVParallelLinear's heads, MergedColumnParallelLinear's neurons,
RowParallelLinear's input columns) are exactly the layout's device l; a shared student's last n
neurons are every rank's, whole (`DTPFFN`, docs/design.md §6). The row-parallel outputs
are left unreduced (`reduce_results=False`): each is the rank's partial p_l^m. The rank keeps its
own residual stream x_l and hands each partial to the exchange (model/exchange.py), the same one
the simulator and the runtime run:

    x_l ← x_l + s_m·p_l^m + Σ_(k, w) w·(Σ_j p_j^k − p_l^k)

Σ_j p_j^k is started when module k is done and taken where the schedule lands it, so δ modules
of compute overlap it, eagerly and compiled. Where the TP ranks share one x86-64 host and keep
their partials in host memory, the partials travel one-sided over shared memory
(transport/shared.py: each rank publishes its partial and reads the others' at the landing, no
collective), whether or not vLLM's own all-reduce does (its CPU build without AVX-512 uses gloo);
elsewhere they are functional collectives on vLLM's TP device group (serve/reduce.py: gloo across
CPU hosts, NCCL on CUDA). The sums that block anyway, a plain module's and the final mean's, take
the ring too where the partials do (transport/choose.py `blocking_sum`), else vLLM's all-reduce.
The engine logs all of it (`tp_reduce`). The output is the mean over ranks of FinalNorm(x_l)
(that blocking sum, divided by L), then vLLM's vocabulary-parallel LM head. Attention is vLLM's
(paged KV cache, continuous batching, chunked prefill, prefix caching), so the engine treats the
student as it treats a Llama.

Where vLLM compiles the forward as pieces split at attention (CUDA's piecewise graphs), every
pending sum is waited for before the attention core, inside the piece that started it: a wait in
a later piece than its collective crashes under CUDA graphs (pytorch/pytorch#192000). The sum is
still added where the schedule lands it, so the function is the same. No per-request state is
kept on a module: the exchange is made per forward.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group, tensor_model_parallel_all_reduce
from vllm.logger import init_logger
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.sequence import IntermediateTensors

from dtpshard.core.errors import UserError
from dtpshard.core.family import VLLM_FUSED
from dtpshard.core.shape import ModelShape
from dtpshard.model.exchange import Exchange
from dtpshard.model.finite import check_logits
from dtpshard.serve.plugin import REFUSAL
from dtpshard.serve.reduce import FunctionalReduce
from dtpshard.serve.student import ServedStudent, check_parallel, served_student
from dtpshard.transport.choose import blocking_sum, choose

logger = init_logger(__name__)
ACT_AND_MUL = {"silu": SiluAndMul}  # vLLM's fused activation-and-multiply per core/family.py ACTIVATIONS name


class TPReduce(FunctionalReduce):
    """The partials' sums over vLLM's TP group by functional collectives (gloo or NCCL): the
    fallback where the shared-memory exchange cannot run."""

    transport = "collective"


EXCHANGE_TIMEOUT = 600.0  # seconds a rank waits on a live peer's partial before it says the peer hung


def tp_reduce(vllm_config: VllmConfig, student: ServedStudent) -> Any:
    """This rank's Reduce over its TP group (transport/choose.py: the shared-memory ring where the
    ranks share a host, else functional collectives), its `total` the path of the sums that block
    anyway (a plain module's, the final mean's). bench/vllm_link.py swaps it to emulate a link or
    remove the reduces."""
    group = get_tp_group()
    s = student.shape
    itemsize = torch.empty((), dtype=vllm_config.model_config.dtype).element_size()
    message = vllm_config.scheduler_config.max_num_batched_tokens * s.hidden * itemsize
    try:
        reduce, said = choose(group.cpu_group, "vllm-tp", student.schedule, message, EXCHANGE_TIMEOUT,
                              lambda: TPReduce(group.device_group.group_name), vllm_config.device_config.device)
    except UserError as e:  # DTPSHARD_EXCHANGE mistyped, or `shared` where it cannot run: one line (serve/plugin.py)
        raise ValueError(REFUSAL + str(e)) from None
    reduce.total, blocking = blocking_sum(reduce, tensor_model_parallel_all_reduce)
    reduce.said = f"{said}; the sums that block (plain modules', the final mean's) over {blocking}"
    if group.rank_in_group == 0:
        logger.info("dtpshard: the DTP student's partials travel over %s", reduce.said)
    return reduce


def split_at_attention(compilation: Any, device: Any = "cpu") -> bool:
    """Whether a forward's CUDA graphs are captured as pieces split at attention, so that no sum may
    stay open across that split (pytorch/pytorch#192000): vLLM's piecewise compilation (Dynamo's FX
    split in VLLM_COMPILE mode, or Inductor's graph partition), or its breakable CUDA graphs
    (VLLM_USE_BREAKABLE_CUDAGRAPH=1, which vLLM turns on by itself for some shapes), which break
    capture at attention even with compilation off. A CPU compiles the forward whole
    (DYNAMO_TRACE_ONCE) and captures nothing."""
    from vllm.config import CompilationMode

    if torch.device(device).type == "cuda" and os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0") not in ("", "0"):
        return True
    if not compilation.splitting_ops or compilation.mode == CompilationMode.NONE:
        return False
    if getattr(compilation, "use_inductor_graph_partition", False):
        return compilation.backend == "inductor"
    return compilation.mode == CompilationMode.VLLM_COMPILE


class DTPAttention(nn.Module):
    """Device l's heads: its q/k/v rows (with biases: qwen2; q/k-norm: qwen3), RoPE, paged attention
    over its KV groups, its o_proj columns. forward returns the partial, unreduced."""

    def __init__(self, student: ServedStudent, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        s, cfg = student.shape, student.family_config
        tp = get_tensor_model_parallel_world_size()
        self.head_dim, self.qk_norm = s.head_dim, s.qk_norm
        heads, groups = s.heads // tp, s.kv_groups // tp
        self.q_size, self.kv_size = heads * s.head_dim, groups * s.head_dim
        quant = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(s.hidden, s.head_dim, s.heads, s.kv_groups, bias=s.qkv_bias,
                                          quant_config=quant, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(s.heads * s.head_dim, s.hidden, bias=False, reduce_results=False,
                                        quant_config=quant, prefix=f"{prefix}.o_proj")
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, eps=s.rms_eps)
            self.k_norm = RMSNorm(s.head_dim, eps=s.rms_eps)
        self.rotary_emb = get_rope(s.head_dim, max_position=getattr(cfg, "max_position_embeddings", 8192),
                                   rope_parameters=getattr(cfg, "rope_parameters", None), is_neox_style=True)
        scale = s.head_dim ** -0.5 if s.attention_scale is None else s.attention_scale
        self.attn = Attention(heads, s.head_dim, scale, num_kv_heads=groups, cache_config=vllm_config.cache_config,
                              quant_config=quant, per_layer_sliding_window=s.window, prefix=f"{prefix}.attn")

    def _norm_heads(self, norm: RMSNorm, t: torch.Tensor) -> torch.Tensor:
        by_head = t.view(*t.shape[:-1], t.shape[-1] // self.head_dim, self.head_dim)  # [tokens, heads, hd]
        return norm(by_head).view(t.shape)

    def forward(self, positions: torch.Tensor, h: torch.Tensor,
                before_attention: Callable[[], None] | None = None) -> torch.Tensor:
        """The partial; `before_attention` runs just before the attention core (a graph split)."""
        qkv, _ = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q, k = self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        if before_attention is not None:
            before_attention()
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class DTPFFN(nn.Module):
    """Device l's neurons: gate/up rows, SwiGLU, its down_proj columns; the partial, unreduced. With
    shared neurons (docs/design.md §6) vLLM's TP shards only the first N - n, and every rank holds
    the last n whole (`shared_gate_up`, `shared_down`, ReplicatedLinear) and adds their output to
    its own stream at once: the `local` of forward's (partial, local)."""

    def __init__(self, s: ModelShape, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        quant = vllm_config.quant_config
        self.gate_up_proj = MergedColumnParallelLinear(s.hidden, [s.sharded] * 2, bias=False, quant_config=quant,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(s.sharded, s.hidden, bias=False, reduce_results=False,
                                           quant_config=quant, prefix=f"{prefix}.down_proj")
        self.act_fn = ACT_AND_MUL[s.act]()
        self.shared = s.shared
        if s.shared:
            self.shared_gate_up = ReplicatedLinear(s.hidden, 2 * s.shared, bias=False, quant_config=quant,
                                                   prefix=f"{prefix}.shared_gate_up")
            self.shared_down = ReplicatedLinear(s.shared, s.hidden, bias=False, quant_config=quant,
                                                prefix=f"{prefix}.shared_down")

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate_up, _ = self.gate_up_proj(h)
        out, _ = self.down_proj(self.act_fn(gate_up))
        if not self.shared:
            return out, None
        gate_up, _ = self.shared_gate_up(h)
        local, _ = self.shared_down(self.act_fn(gate_up))
        return out, local


class DTPDecoderLayer(nn.Module):
    """Modules 2i (attention) and 2i + 1 (FFN), each on the pre-norm of this rank's own stream."""

    def __init__(self, student: ServedStudent, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        s = student.shape
        self.input_layernorm = RMSNorm(s.hidden, eps=s.rms_eps)
        self.self_attn = DTPAttention(student, vllm_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(s.hidden, eps=s.rms_eps)
        self.mlp = DTPFFN(s, vllm_config, f"{prefix}.mlp")
        self.residual_multiplier = s.residual_multiplier

    def partial(self, attention: bool, positions: torch.Tensor, x: torch.Tensor, exchange: Exchange,
                split: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(partial, local) as model/modules.py's Module.partials: local is a shared FFN's, else None."""
        local = None
        if attention:
            p = self.self_attn(positions, self.input_layernorm(x), exchange.settle if split else None)
        else:
            p, local = self.mlp(self.post_attention_layernorm(x))
        m = self.residual_multiplier
        return (p, local) if m == 1 else (p * m, None if local is None else local * m)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class DTPDecoder(nn.Module):
    """Embedding, the layers over the delay schedule, the mean of the final norms: the LM head's input."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        student = served_student(vllm_config.model_config.hf_config)
        parallel = vllm_config.parallel_config
        check_parallel(student, get_tensor_model_parallel_world_size(), parallel.pipeline_parallel_size)
        s = student.shape
        self.student = student  # frozen settings and schedule: no per-request state
        self.reduce = tp_reduce(vllm_config, student)
        self.split = split_at_attention(vllm_config.compilation_config, vllm_config.device_config.device)
        self.embed_tokens = VocabParallelEmbedding(s.vocab, s.hidden, quant_config=vllm_config.quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(DTPDecoderLayer(student, vllm_config, f"{prefix}.layers.{i}")
                                    for i in range(s.layers))
        self.norm = RMSNorm(s.hidden, eps=s.rms_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(input_ids)
        m = self.student.shape.embedding_multiplier
        return e if m == 1 else e * m

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens] ids -> h = mean_l FinalNorm(x_l) [tokens, D], the same on every rank."""
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)  # x_l = embedding
        exchange = Exchange(self.student.schedule, self.reduce, self.student.settings.devices)
        for m in range(len(self.student.schedule)):
            p, local = self.layers[m // 2].partial(m % 2 == 0, positions, x, exchange, self.split)  # [tokens, D]
            x = exchange.update(m, x, p, local)
        return exchange.mean(self.norm(x))


class DTPForCausalLM(nn.Module):
    """vLLM's model for a DTP student (architecture "DTPForCausalLM", model_type "dtp")."""

    # vLLM's fused parameters and the student's tensors they stack (core/family.py VLLM_FUSED; a
    # student stores every family's layers under the canonical names)
    packed_modules_mapping = {fused.rpartition(".")[2]: [p.rpartition(".")[2] for p, _ in parts]
                              for fused, parts in VLLM_FUSED.items()}
    stacked_params_mapping = [(f".{fused.rpartition('.')[2]}", f".{p.rpartition('.')[2]}", shard)
                              for fused, parts in VLLM_FUSED.items() for p, shard in parts]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.model = DTPDecoder(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        s = self.model.student.shape
        self.tied = s.tied
        self.lm_head = ParallelLMHead(s.vocab, s.hidden, quant_config=vllm_config.quant_config,
                                      prefix=f"{prefix}.lm_head" if prefix else "lm_head")
        if s.tied:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(s.vocab, scale=1 / s.logits_scaling)
        self.checked = False  # whether a forward's logits were checked finite (model/finite.py)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if not self.checked and logits is not None:  # the first forward (vLLM's own warm-up included)
            self.checked = True
            try:
                check_logits(logits, self.model.student.family_config, "the student served")
            except UserError as e:  # one line where nothing catches it (serve/plugin.py)
                raise ValueError(REFUSAL + str(e)) from None
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The student's safetensors under the family's names; q/k/v and gate/up go into vLLM's fused
        parameters, each rank taking its contiguous shard (= its device's units)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self._split_shared(weights, params, loaded):
            if name.endswith("rotary_emb.inv_freq") or (self.tied and name.startswith("lm_head.")):
                continue
            shard = None
            for fused, part, shard_id in self.stacked_params_mapping:
                if part + "." in name:
                    name, shard = name.replace(part + ".", fused + "."), shard_id
                    break
            if name not in params:
                raise UserError(f"the student's weights hold {name!r}, which its {self.model.student.shape.family} "
                                "architecture has no parameter for")
            param = params[name]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(name)
        return loaded

    def _split_shared(self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, Any],
                      loaded: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights, a shared student's FFN tensors cut in two (docs/design.md §6): the first
        N - n neurons on to vLLM's TP loaders, the last n copied whole into every rank's
        shared_gate_up (gate rows, then up rows) and shared_down."""
        s = self.model.student.shape
        halves = {"gate_proj": 0, "up_proj": 1}
        for name, tensor in weights:
            stem, _, kind = name.rpartition(".mlp.")
            if not s.shared or kind not in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
                yield name, tensor
                continue
            if kind == "down_proj.weight":
                target, part = f"{stem}.mlp.shared_down.weight", tensor[:, s.sharded:]
                params[target].data.copy_(part)
                yield name, tensor[:, :s.sharded]
            else:
                target, half = f"{stem}.mlp.shared_gate_up.weight", halves[kind.partition(".")[0]]
                params[target].data[half * s.shared:(half + 1) * s.shared].copy_(tensor[s.sharded:])
                yield name, tensor[:s.sharded]
            loaded.add(target)
