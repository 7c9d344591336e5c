"""Vocabulary parallelism in the pipeline executor: stage modules and handlers for the vocabulary kinds.

The pipeline stages keep their transformer layers; the token embedding and the output layer leave them:
stage 0 takes the token-embedding output (the SUM of every rank's lookup, action VEC) and adds the
position embedding, the last stage ends at the final LayerNorm, its output X. Every rank holds one
vocabulary shard of both layers (:class:`~.layers.VocabEmbedding`, :class:`~.layers.VocabOutput`),
initialised as the rows of the full model's tables, so the loss and every gradient equal the
unpartitioned model's.

:meth:`VocabRuntime.handlers` gives the executor (``PipelineExecutor(handlers=...)``) one handler per
vocabulary kind plus F/B/I wrappers for the first and last stage:

- ``VEF``/``VEC``: lookup of microbatch k's ids, then the SUM issued to stage 0; F(0, k) waits for it;
- ``VBX``: the last stage's X broadcast (issued on every rank); ``VS`` waits for it (not on the root,
  which has X) and runs S, which issues the statistics all-gather (naive: ``VSM`` waits for X, computes
  the logits and issues the MAX all-reduce, ``VCM`` does nothing, ``VS`` waits for the max and issues
  the SUM of Σexp and target); ``VC0`` blocks nothing (Algorithm 2: the merge, which issues the SUM
  of ∇X, runs on one reduction thread in ``VC0`` order);
- ``VT``: pass T with dℓ = 1/(tokens·m) per token (the executor's mean-loss scaling); Algorithm 1
  issues the SUM of ∇X; ``VC1`` leaves it to :meth:`VocabRuntime.finish` on the ranks that do not
  need it. No vocabulary collective blocks the rank that issues it (the simulator's rule);
- B/I of the last stage back-propagate ∇X (waited for there) through the stage;
- ``VEBC``: stage 0 broadcasts the gradient of its input; ``VEB`` scatters it into the rank's rows.

Build the executor with ``loss_fn=None`` (the loss is computed here, on every rank). Every rank needs
the microbatches' ids and labels (``run(inputs, targets)`` on every rank). Call
:meth:`VocabRuntime.finish` after each iteration (it completes the collectives whose result this rank
does not use).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipewright.features.vocab import shard as vs
from pipewright.features.vocab.kinds import VBX, VC0, VC1, VCM, VEB, VEBC, VEC, VEF, VS, VSM, VT
from pipewright.features.vocab.layers import Pending, VocabEmbedding, VocabGroup, VocabOutput
from pipewright.ir import Action, B, F, I
from pipewright.models.gpt import Embedding, GPTStage, Head, layer_generator
from pipewright.models.spec import ModelSpec
from pipewright.models.wgrad import plain_linear_factory
from pipewright.runtime.core.executor import default_handlers


class VocabStage(nn.Module):
    """A :class:`GPTStage` without its vocabulary layers: stage 0 adds the position embedding to the
    token-embedding output it is given; the last stage stops at the final LayerNorm."""

    def __init__(self, stage: GPTStage) -> None:
        super().__init__()
        self.pos = stage.embed.pos if stage.embed is not None else None
        self.layers = stage.layers
        self.norm = stage.head.norm if stage.head is not None else None

    def forward(self, x: Tensor) -> Tensor:
        if self.pos is not None:
            x = x + self.pos(torch.arange(x.shape[1], device=x.device)).unsqueeze(0)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        return x


def full_vocab_weights(spec: ModelSpec, seed: int) -> tuple[Tensor, Tensor]:
    """The full model's token-embedding and output weights (V × h), initialised as build_full does."""
    emb = Embedding(spec)
    emb.reset_parameters(spec, layer_generator(seed, "embed"))
    head = Head(spec, plain_linear_factory)
    head.reset_parameters(spec, layer_generator(seed, "head"))
    return emb.tok.weight.detach(), head.out.weight.detach()


@dataclass
class _Iteration:
    emb_local: dict[int, Tensor] = field(default_factory=dict)
    emb_out: dict[int, Pending] = field(default_factory=dict)
    emb_inputs: dict[int, Tensor] = field(default_factory=dict)
    emb_grad: dict[int, Pending] = field(default_factory=dict)
    x_bcast: dict[int, Pending] = field(default_factory=dict)
    grad_x: dict[int, Tensor] = field(default_factory=dict)
    merges: dict[int, Future] = field(default_factory=dict)  # alg2: merge of microbatch k, in flight
    leftovers: list[Pending] = field(default_factory=list)


class VocabRuntime:
    """This rank's vocabulary shards and the executor handlers that drive them (see the module)."""

    def __init__(
        self,
        spec: ModelSpec,
        group: VocabGroup,
        *,
        algorithm: str = "alg2",
        seed: int = 0,
        chunk: int | None = None,
        microbatch_shape: tuple[int, int] = (1, 1),
        last_rank: int | None = None,
    ) -> None:
        emb_full, out_full = full_vocab_weights(spec, seed)
        q = group.index
        self.embedding = VocabEmbedding(
            nn.Parameter(vs.split_weight(emb_full, group.shards)[q]), spec.vocab, group
        )
        self.output = VocabOutput(
            nn.Parameter(vs.split_weight(out_full, group.shards)[q]), spec.vocab, group, algorithm, chunk
        )
        if last_rank is not None:  # the pp rank holding the last stage (rank 0 under the V placement)
            self.output.source = group.ranks[last_rank * group.tp]
        self.spec, self.group, self.algorithm = spec, group, algorithm
        self.shape = microbatch_shape  # (b, s)
        self._it = _Iteration()
        self._waited_s = 0.0
        self._pool: ThreadPoolExecutor | None = None  # Algorithm 2's reduction thread, made on first use

    @property
    def waited_s(self) -> float:
        """Seconds this rank's handlers spent blocked in vocabulary collectives inside compute passes
        (F(0) on the embedding sum, VS on the X broadcast, the last stage's B/I on ∇X, VEB on the
        embedding gradient; the last includes scaling ∇X, microseconds): what a measurement of the
        passes' own work subtracts."""
        return self._waited_s

    def _wait(self, pending: Pending):
        value = pending.wait()
        self._waited_s += pending.waited_s
        return value

    def parameters(self) -> list[nn.Parameter]:
        return [self.embedding.weight, self.output.weight]

    def finish(self) -> None:
        """Complete this iteration's collectives that this rank only contributed to."""
        for pending in self._it.leftovers:
            pending.wait()
        self._it = _Iteration()

    # -- handlers ---------------------------------------------------------------------------------
    def handlers(self) -> dict:
        core = default_handlers()
        return {
            F: self._forward(core[F]),
            B: self._backward(core[B]),
            I: self._backward(core[I]),
            VEF: self._vef,
            VEC: self._vec,
            VBX: self._vbx,
            VSM: self._vsm,
            VCM: self._vcm,
            VS: self._vs,
            VC0: self._vc0,
            VT: self._vt,
            VC1: self._vc1,
            VEBC: self._vebc,
            VEB: self._veb,
        }

    @property
    def _tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    def _vef(self, state, a: Action) -> None:
        self._it.emb_local[a.microbatch] = self.embedding.lookup(state.inputs[a.microbatch])

    def _vec(self, state, a: Action) -> None:
        pending = self.embedding.reduce(self._it.emb_local.pop(a.microbatch))
        if 0 in state.executor.stages:
            self._it.emb_out[a.microbatch] = pending
        else:
            self._it.leftovers.append(pending)

    def _forward(self, core):
        def handler(state, a: Action) -> None:
            if a.stage == 0:  # stage 0's input: the token-embedding SUM (VEC)
                x = self._wait(self._it.emb_out.pop(a.microbatch)).detach().requires_grad_()
                self._it.emb_inputs[a.microbatch] = x
                state.feeds[(0, a.microbatch)] = x
            core(state, a)

        return handler

    def _vbx(self, state, a: Action) -> None:
        ex, k = state.executor, a.microbatch
        h = self.spec.hidden
        x = None
        if ex.last_stage in ex.stages:
            x = state.stage_outputs[(ex.last_stage, k)].detach().reshape(-1, h)
        labels = state.targets[k].reshape(-1)
        self._it.x_bcast[k] = self.output.receive_input(k, x, labels, (self._tokens, h))

    def _x(self, state, k: int) -> None:
        """X of microbatch k for S: waited for on the receivers; the broadcast's root (the last stage's
        rank) holds X already and does not wait for its own broadcast, as the reference's root does
        not — the send completes later (:meth:`finish`)."""
        pending = self._it.x_bcast.pop(k)
        if self._last(state):
            self._it.leftovers.append(pending)
        else:
            self._wait(pending)

    def _vsm(self, state, a: Action) -> None:
        self._x(state, a.microbatch)
        self.output.s_max(a.microbatch)

    def _vcm(self, state, a: Action) -> None:
        """The MAX all-reduce was issued by ``VSM``; only ``VS`` needs its result (it overlaps what the
        schedule puts between them)."""

    def _vs(self, state, a: Action) -> None:
        k = a.microbatch
        if self.algorithm == "naive":  # X arrived for VSM; the rest of S waits for the max
            self._wait(self.output.row_max(k))
        else:
            self._x(state, k)
        self.output.s_pass(k)

    def _vc0(self, state, a: Action) -> None:
        """The barrier after S was issued by ``VS``; issuing it blocks no rank (the simulator's rule
        for pipeline-wide collectives). Algorithm 2's merge then issues the SUM of the rescaled ∇X: it
        runs on the reduction thread (the reference's reduction stream), in this action's order, the
        same on every rank, while the executor goes on."""
        if self.algorithm != "alg2":
            return  # T and the loss wait for the merge where they need it
        merged = self.output._mb[a.microbatch].merged
        self._it.merges[a.microbatch] = self._reducer().submit(merged.wait)

    def _merged(self, k: int) -> None:
        """Algorithm 2: wait until the reduction thread has merged microbatch k (and so every earlier
        one: one thread, in order), so this thread never issues a SUM of ∇X out of that order."""
        future = self._it.merges.pop(k, None)
        if future is not None:
            future.result()

    def _reducer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocab-reduce")
        return self._pool

    def _last(self, state) -> bool:
        return state.executor.last_stage in state.executor.stages

    def _vt(self, state, a: Action) -> None:
        k = a.microbatch
        self._merged(k)
        if self._last(state):
            state.losses[k] = self.output.loss(k).mean().detach()
        self.output.t_pass(k, self._dloss(state))
        if self.algorithm == "alg2" and not self._last(state):
            self._it.leftovers.append(Pending(None, lambda k=k: self.output.input_grad(k)))

    def _dloss(self, state) -> Tensor:
        """dℓ per token: the executor's loss is the token mean over m microbatches."""
        m = state.executor.schedule.num_microbatches
        w = self.output.weight
        return torch.full((self._tokens,), 1.0 / (self._tokens * m), dtype=w.dtype, device=w.device)

    def _vc1(self, state, a: Action) -> None:
        """Issued by ``VT``; a rank that does not need ∇X does not wait for it (:meth:`finish` does)."""
        if not self._last(state):
            self._it.leftovers.append(Pending(None, lambda k=a.microbatch: self.output.input_grad(k)))

    def _backward(self, core):
        def handler(state, a: Action) -> None:
            ex, (s, k) = state.executor, (a.stage, a.microbatch)
            if s == ex.last_stage:
                out = state.stage_outputs[(s, k)]
                t0 = time.perf_counter()
                self._merged(k)
                grad = self.output.input_grad(k, self._dloss(state))
                self._waited_s += time.perf_counter() - t0
                state.output_grads[(s, k)] = grad.reshape(out.shape)
            core(state, a)

        return handler

    def _vebc(self, state, a: Action) -> None:
        k = a.microbatch
        ids = state.inputs[k]
        grad = None
        if 0 in state.executor.stages:
            grad = self._it.emb_inputs.pop(k).grad
        self._it.emb_grad[k] = self.embedding.backward(ids, grad)

    def _veb(self, state, a: Action) -> None:
        self._wait(self._it.emb_grad.pop(a.microbatch))


def vocab_group(mesh) -> VocabGroup:
    """Collective over the world: the vocabulary group of every data-parallel replica of ``mesh`` (a
    ParallelMesh), shard q = pp_rank·t + tp_rank; returns this rank's."""
    from pipewright.runtime.parallel.process_mesh import coords_to_rank

    mine = None
    for d in range(mesh.dp):
        ranks = [
            coords_to_rank(d, p, t, mesh.dp, mesh.pp, mesh.tp) for p in range(mesh.pp) for t in range(mesh.tp)
        ]
        group = VocabGroup.create(ranks, tp=mesh.tp)
        if d == mesh.dp_rank:
            mine = group
    assert mine is not None
    return mine


#: VocabStage parameter names → the full model's (GPTStage) names.
def full_name(name: str) -> str:
    if name.startswith("pos."):
        return "embed." + name
    if name.startswith("norm."):
        return "head." + name
    return name
