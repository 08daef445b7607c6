"""A process-group backend for the CPU that behaves like NCCL on a dead peer, for tests/test_abort.py.

Gloo notices a dead peer by itself: a collective fails with "Connection closed by peer" as soon as
the peer's socket closes. NCCL does not, within a node: a rank blocked in a collective (or in the
CUDA sync after it) spins until the group's timeout, unless someone calls ``ProcessGroup.abort()``,
which releases it -- silently, where it was blocked in a CUDA sync. hydra_fsdp relies on that abort
(``_abort``); on gloo that path never runs. This backend makes it run on the CPU:

* every collective is gloo's, on a real gloo group built from the same store;
* one that fails because the peer is gone does not raise: it blocks, the GIL released, until
  ``abort()`` is called on the group (from any thread), then returns as if it had completed; not
  aborted within the group's timeout, it raises, as NCCL's watchdog would;
* AVG (which Lightning asks of any backend but gloo) is gloo's SUM, then divided as ncclAvg does;
* any collective after the abort raises ``RuntimeError("... communicator was aborted ...")``, as
  NCCL's does -- or, with ``STUB_BACKEND_AFTER_ABORT=complete`` in the environment, returns at once
  as if completed: the abort released rank 0 silently and nothing later fails, so Lightning would
  go on to the end of the stage;
* ``shutdown()``/destroy lets go of the gloo group.

It is a Python subclass of ``torch.distributed.ProcessGroup`` (pybind's trampoline ``PyProcessGroup``
forwards the virtual ``abort``, ``allreduce``, ``broadcast``, ``allgather``, ``barrier``... to Python,
so DDP's C++ reducer and ``_broadcast_coalesced`` reach it too), registered with
``torch.distributed.Backend.register_backend(NAME, creator, devices=["cpu"])``: a creator that returns
a ProcessGroup subclass is the group itself (``_new_process_group_helper``), so
``init_process_group(backend=NAME)`` -- Lightning's ``DDPStrategy(process_group_backend=NAME)`` --
builds it. torch >= 2.7 (``ProcessGroup.abort`` is bound, and hydra_fsdp calls it from its thread).

ProcessGroup's bindings of the newer single-tensor names (``all_gather_single``,
``reduce_scatter_single``; torch 2.13 and 2.15 alike) do not reach the trampoline: they ask the group
for its backend for the tensor's device, and this group registers none ("No backend type associated
with device type cpu"). torch 2.15's ``all_gather_object`` (hydra_fsdp's ``_check_ranks_agree``) calls
``all_gather_single``, where 2.13's called ``allgather``; so the class defines those names itself
(Python finds them before the binding), as gloo's ``_allgather_base``/``_reduce_scatter_base``...

Imported on every rank (``import stub_backend`` registers it; see tests/test_abort.py's
sitecustomize). ``STUB_BACKEND_LOG`` names a file each rank appends what happened to (the test reads it).
"""

import itertools
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

NAME = "hangs_on_dead_peer"
# set when a collective of this process blocks on a dead peer: a test's thread waits on it to abort
# only once the collective blocks, as NCCL's would be
blocked_on_dead_peer = threading.Event()
_built = itertools.count()
# What gloo says when the peer's process is gone (its socket closed or reset under a transfer).
PEER_GONE = ("Connection closed by peer", "Connection reset", "Broken pipe", "Socket closed")


def _note(what):
    path = os.environ.get("STUB_BACKEND_LOG")
    line = f"{time.time():.3f} pid {os.getpid()} rank {os.environ.get('LOCAL_RANK', '0')}: {what}\n"
    if path:
        with open(path, "a") as f:
            f.write(line)
    print(f"stub_backend: {line}", end="", file=sys.stderr, flush=True)


def _done(result=None):
    """A Work that has completed, with ``result`` as its future's value (what DDP's reducer reads)."""
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


class HangsOnDeadPeer(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        # (rank, size): the constructor that builds pybind's trampoline; (store, rank, size) builds a
        # plain ProcessGroup and refuses a subclass ("returned holder-wrapped instance is not an alias
        # instance")
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        self._timeout = timeout
        self._number = next(_built)
        _note(f"building a {NAME} group {self._name()} (rank {rank})")
        self._aborted = threading.Event()

    def getBackendName(self):  # what dist.get_backend and DDP's logger read from C++
        return NAME

    # -- what NCCL would do

    def abort(self):
        """Release every collective blocked on a dead peer; any later one fails (or completes)."""
        _note(f"abort() called on group {self._name()} (from thread {threading.current_thread().name})")
        self._aborted.set()

    def _name(self):
        """``#<n> of <size>``: the n-th group this process built (#0: its first job's default group)."""
        return f"#{self._number} of {self.size()}"

    def shutdown(self):
        _note("shutdown() called")
        self._gloo = None

    def _run(self, what, start, result):
        what = f"{what} on group {self._name()}"
        if self._aborted.is_set():
            if os.environ.get("STUB_BACKEND_AFTER_ABORT") == "complete":
                return _done(result)
            raise RuntimeError(f"{NAME}: {what}: communicator was aborted (as NCCL's after ncclCommAbort)")
        try:
            work = start(self._gloo)
            work.wait()
            return work
        except RuntimeError as error:
            if not any(text in str(error) for text in PEER_GONE):
                raise
            _note(f"{what}: the peer is gone ({str(error).splitlines()[0]}); blocking until abort()")
            blocked_on_dead_peer.set()
            # releases the GIL, as a thread blocked in NCCL does; NCCL's watchdog would give up at the
            # group's timeout (30 min by default) and, with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, abort
            if not self._aborted.wait(self._timeout.total_seconds()):
                _note(f"{what}: not aborted within the group's timeout ({self._timeout})")
                raise RuntimeError(f"{NAME}: {what} timed out after {self._timeout} waiting for a dead peer")
            _note(f"{what}: released by abort(), returning as if completed")
            return _done(result)

    # -- the collectives, each gloo's

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts if isinstance(opts, dist.AllreduceOptions) else _allreduce_opts(opts)
        if opts.reduceOp == dist.ReduceOp.AVG:
            # Lightning asks any backend but gloo for AVG (of an integer count too, which gloo's AVG
            # cannot write back): SUM, then divide as NCCL's ncclAvg does (integers: truncated).
            summed = dist.AllreduceOptions()
            summed.reduceOp = dist.ReduceOp.SUM
            summed.timeout = opts.timeout
            work = self._run("allreduce", lambda g: g.allreduce(tensors, summed), tensors)
            if not self._aborted.is_set():
                for tensor in tensors:
                    if tensor.is_floating_point() or tensor.is_complex():
                        tensor.div_(self.size())
                    else:
                        tensor.copy_(torch.div(tensor, self.size(), rounding_mode="trunc"))
            return work
        return self._run("allreduce", lambda g: g.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", lambda g: g.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not isinstance(opts, dist.BroadcastOptions):
            root, opts = opts or 0, dist.BroadcastOptions()
            opts.rootRank = root
        return self._run("broadcast", lambda g: g.broadcast(tensors, opts), tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run(
            "allgather", lambda g: g.allgather(output_tensors, input_tensors, opts), output_tensors
        )

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("_allgather_base", lambda g: g._allgather_base(output, input, opts), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run(
            "allgather_into_tensor_coalesced",
            lambda g: g.allgather_into_tensor_coalesced(outputs, inputs, opts),
            outputs,
        )

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        return self._run("gather", lambda g: g.gather(output_tensors, input_tensors, opts), output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._run("scatter", lambda g: g.scatter(output_tensors, input_tensors, opts), output_tensors)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._run("reduce", lambda g: g.reduce(tensors, opts), tensors)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run(
            "reduce_scatter", lambda g: g.reduce_scatter(output_tensors, input_tensors, opts), output_tensors
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run(
            "_reduce_scatter_base", lambda g: g._reduce_scatter_base(output, input, opts), [output]
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run(
            "alltoall_base",
            lambda g: g.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts),
            [output],
        )

    def gather_single(self, output, input, opts=None):
        opts = opts or dist.GatherOptions()
        return self._run("gather_single", lambda g: g.gather_single(output, input, opts), [output])

    # The Python API's single-tensor names: ProcessGroup's binding of all_gather_single and
    # reduce_scatter_single asks for the group's backend for the device (it has none), not the
    # trampoline; torch 2.15's all_gather_object calls group.all_gather_single. Python finds these first.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts=None):
        opts = opts if isinstance(opts, dist.BarrierOptions) else dist.BarrierOptions()
        return self._run("barrier", lambda g: g.barrier(opts), None)

    def send(self, tensors, dst, tag=0):
        return self._run("send", lambda g: g.send(tensors, dst, tag), tensors)

    def recv(self, tensors, src, tag=0):
        return self._run("recv", lambda g: g.recv(tensors, src, tag), tensors)


def _allreduce_opts(op):
    opts = dist.AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return opts


def _create(store, rank, size, timeout):
    return HangsOnDeadPeer(store, rank, size, timeout if timeout is not None else timedelta(minutes=30))


if NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(NAME, _create, devices=["cpu"])
