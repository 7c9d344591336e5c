"""Runs the authors' vocabulary-parallel 1F1B function on stand-ins and records the passes each rank
issues, in order (Yeung et al., arXiv 2411.05288; sail-sg/VocabularyParallelism,
``megatron/core/pipeline_parallel/vocab_parallel_schedule.py``,
``forward_backward_pipelining_with_vocab_parallel``).

The file is read from a checkout of that repository and executed unchanged; its imports of ``torch``
and ``megatron`` receive stand-ins that compute nothing and note each pass and each collective:

- ``F{k}`` / ``B{k}``: the transformer stage's forward / backward (model chunk 0);
- ``S{k}``: one output-layer step (chunk 1: T(k − 1) then S(k); ``S{m}`` is T(m − 1) only);
- ``X{k}``: a broadcast from the last pipeline rank (X(k) with the loss gradient of k − 1);
- ``C{k}``: a block of all-reduces on the reduction stream that starts with the MAX (the statistics;
  Algorithm 2 also the SUM of the rescaled input gradient); ``G{k}``: a block that is one SUM (Algorithm
  1's input gradient after T);
- ``EF{k}`` / ``EC{k}``: the embedding forward (chunk 2) / its SUM all-reduce;
- ``EX{k}`` / ``EB{k}``: the broadcast of the embedding gradient from the first rank / its backward.

Passes are numbered in the order a rank runs them (the reference runs each in microbatch order); the
marker all-reduce the reference issues before ``EC`` and ``EX`` is not a pass of its own.
"""

from __future__ import annotations

import builtins
import contextlib
from pathlib import Path
from types import SimpleNamespace

#: the function's file inside a checkout of sail-sg/VocabularyParallelism
SOURCE = "megatron/core/pipeline_parallel/vocab_parallel_schedule.py"


class _Value:
    """A tensor stand-in: every attribute is a method that returns the value, every operation too."""

    shape = (1, 1, 2)

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self

    def __getitem__(self, key):
        return self

    def __setitem__(self, key, value) -> None:
        pass

    def item(self) -> int:
        return 1

    def _self(self, *args):
        return self

    __add__ = __sub__ = __mul__ = __truediv__ = __radd__ = __rsub__ = __rmul__ = _self
    __iadd__ = __isub__ = __imul__ = __itruediv__ = __neg__ = _self


class _Chunk:
    def __init__(self, index: int) -> None:
        self.index = index


class _Recorder:
    """The stand-ins of one rank's run, and the passes they noted."""

    def __init__(self, rank: int, p: int, fused: bool, f: float, b: float, c: float) -> None:
        self.rank, self.p = rank, p
        self.out: list[str] = []
        self.count: dict[str, int] = {}
        self.marker = False  # the marker all-reduce was issued: the next collective is EC or EX
        self.block: list[str] | None = None  # the reduction-stream block being issued
        self.store = SimpleNamespace(microbatch_id=0)
        self.conclusion = [((f, b, 0.0, c),)]
        self.args = SimpleNamespace(
            profile=False,
            disable_backward_fusion=not fused,
            schedule_timer_start=10**9,
            schedule_timer_end=0 if (f, b, c) != (1.0, 2.0, 0.0) else 10**9,
        )

    def note(self, kind: str, k: int | None = None) -> None:
        if k is None:
            k = self.count.get(kind, 0)
            self.count[kind] = k + 1
        name = f"{kind}{k}"
        if not self.out or self.out[-1] != name:
            self.out.append(name)

    # -- passes ------------------------------------------------------------------------------------
    def forward_step(self, func, data, model: _Chunk, m, input_tensor, *args, current_microbatch=0, **kw):
        if model.index == 0:
            self.note("F", current_microbatch)
        elif model.index == 1:
            self.note("S", self.store.microbatch_id)
        elif model.index == 2:
            self.note("EF", current_microbatch)
        return [_Value()], _Value()

    def backward_step(self, input_tensor, output_tensor, grad, model_type, config, **kw):
        if input_tensor == [None]:  # the embedding's input (its callback runs after other chunks)
            self.note("EB")
        elif self.chunk == 0:
            self.note("B")
        elif self.chunk == 1:
            self.note("S", self.store.microbatch_id)
        return [_Value()]

    # -- collectives -------------------------------------------------------------------------------
    def broadcast(self, tensor, src, group=None, async_op=False):
        if src == self.p - 1 and not self.marker:
            self.note("X")
        else:
            self.note("EX")
        self.marker = False
        return SimpleNamespace(wait=lambda: None)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        if tensor is self.wait_tensor:
            self.marker = True
        elif self.marker:
            self.note("EC")
            self.marker = False
        elif self.block is not None:
            if not self.block:
                self.note("C" if op == "MAX" else "G")
            self.block.append(op)
        return SimpleNamespace(wait=lambda: None)

    @contextlib.contextmanager
    def stream(self, s):
        self.block = []
        yield
        self.block = None

    # -- the modules the file imports ---------------------------------------------------------------
    def modules(self) -> tuple[SimpleNamespace, SimpleNamespace]:
        self.chunk = 0
        self.wait_tensor = None

        def tensor_ctor(*args, **kwargs):
            value = _Value()
            if self.wait_tensor is None and args == ([0],):
                self.wait_tensor = value
            return value

        stream = SimpleNamespace(wait_stream=lambda s: None)
        torch = SimpleNamespace(
            Tensor=tensor_ctor,
            tensor=lambda *a, **k: _Value(),
            empty=lambda *a, **k: _Value(),
            log=lambda x: _Value(),
            cat=lambda *a, **k: _Value(),
            float32="float32",
            int="int",
            nn=SimpleNamespace(Module=type("Module", (), {})),
            cuda=SimpleNamespace(
                Stream=lambda: stream,
                current_stream=lambda: stream,
                current_device=lambda: 0,
                stream=self.stream,
                nvtx=SimpleNamespace(range_push=lambda n: None, range_pop=lambda: None),
            ),
            distributed=SimpleNamespace(
                broadcast=self.broadcast,
                all_reduce=self.all_reduce,
                all_gather_into_tensor=lambda *a, **k: None,
                ReduceOp=SimpleNamespace(MAX="MAX", SUM="SUM"),
            ),
        )
        rank, p = self.rank, self.p

        def set_chunk(c: int) -> None:
            self.chunk = c

        state = SimpleNamespace(
            is_pipeline_last_stage=lambda: rank == p - 1,
            is_pipeline_first_stage=lambda: rank == 0,
            get_pipeline_model_parallel_world_size=lambda: p,
            get_pipeline_model_parallel_rank=lambda: rank,
            get_pipeline_model_parallel_last_rank=lambda: p - 1,
            get_pipeline_model_parallel_first_rank=lambda: 0,
            get_lm_head_model_parallel_group=lambda: "lm_head",
            get_tensor_model_parallel_world_size=lambda: 1,
            set_virtual_vocab_parallel_chunk=set_chunk,
        )
        config = SimpleNamespace(
            overlap_p2p_comm=False,
            finalize_model_grads_func=None,
            timers=None,
            no_sync_func=None,
            grad_sync_func=None,
            variable_seq_lengths=False,
            sequence_parallel=False,
            pipeline_dtype="bf16",
            deallocate_pipeline_outputs=False,
            num_microbatches_with_partial_activation_checkpoints=None,
        )
        timer = SimpleNamespace(start=lambda: None, stop=lambda: None)
        timers = type(
            "Timers",
            (),
            {
                "iter_counter": 0,
                "sync_timer": True,
                "joint_conclusion": staticmethod(lambda **kw: self.conclusion),
                "for_chunk": staticmethod(
                    lambda c: SimpleNamespace(
                        s=timer, input_f=timer, input_b=timer, s_cnt=0, input_f_cnt=0, input_b_cnt=0
                    )
                ),
            },
        )
        fresh = lambda *a, **k: [_Value()]  # noqa: E731
        megatron = SimpleNamespace(
            parallel_state=state,
            forward_step=self.forward_step,
            backward_step=self.backward_step,
            get_tensor_shapes=lambda **k: [(1, 1, 2)],
            check_first_val_step=lambda *a: False,
            deallocate_output_tensor=lambda *a: None,
            recv_forward=fresh,
            send_forward=lambda *a: None,
            recv_backward=fresh,
            send_backward=lambda *a: None,
            send_forward_recv_backward=fresh,
            send_backward_recv_forward=fresh,
            clear_embedding_activation_buffer=lambda *a: None,
            bootstrap_and_profile_p2p_communication=lambda *a: None,
            finish_embedding_wgrad_compute=lambda *a: None,
            ScheduleTimers=timers,
            VocabOutputStore=SimpleNamespace(
                microbatch_id=0,
                forward_get=lambda: tuple(_Value() for _ in range(6)),
                backward_store=lambda *a: None,
            ),
            VocabInputStore=SimpleNamespace(
                forward_store=lambda *a: None, backward_store=lambda *a: None, backward_get=lambda: _Value()
            ),
            get_model_config=lambda m: config,
            get_model_type=lambda m: None,
            get_model_xattn=lambda m: False,
            get_args=lambda: self.args,
        )
        self.store = megatron.VocabOutputStore
        return torch, megatron


def trace(path: Path, p: int, m: int, *, fused: bool = True, f: float = 1.0, b: float = 2.0, c: float = 0.0):
    """Every rank's passes when the reference function in ``path`` (a checkout of
    sail-sg/VocabularyParallelism, or the file itself) runs ``m`` microbatches on ``p`` pipeline ranks;
    ``fused``: Algorithm 2 (the default, backward fusion on), else Algorithm 1; ``f``, ``b``, ``c``: the
    timers the reference reads (forward, backward, embedding forward; without them it takes 1, 2, 0)."""
    path = Path(path)
    if path.is_dir():
        path = path / SOURCE
    code = compile(path.read_text(), str(path), "exec")
    orders = []
    for rank in range(p):
        rec = _Recorder(rank, p, fused, f, b, c)
        torch, megatron = rec.modules()

        def fake_import(
            name, globals=None, locals=None, fromlist=(), level=0, torch=torch, megatron=megatron
        ):
            if name == "torch" or name.startswith("torch."):
                return torch
            if name.startswith("megatron"):
                return megatron
            return builtins.__import__(name, globals, locals, fromlist, level)

        scope = {"__builtins__": {**vars(builtins), "__import__": fake_import}, "__name__": "vp_reference"}
        exec(code, scope)
        scope["forward_backward_pipelining_with_vocab_parallel"](
            forward_step_func=None,
            data_iterator=None,
            model=[_Chunk(i) for i in range(4)],
            num_microbatches=m,
            seq_length=1,
            micro_batch_size=1,
        )
        orders.append(rec.out)
    return orders
