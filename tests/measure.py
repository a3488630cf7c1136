"""Measuring what tensors a piece of code allocates, for the memory plan's checks (tests/test_memory_plan.py,
tests/test_gpu_path.py)."""

from torch.distributed.tensor import DTensor


def storage_bytes(tensors) -> int:
    "Bytes of the distinct storages behind `tensors` (a DTensor's local shard)"
    seen = {}
    for t in tensors:
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def profiled_peak(fn) -> int:
    "The peak CPU bytes `fn` allocates in this thread beyond what was there before (torch's memory profiler)"
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, (key, _), size in prof._memory_profile().timeline:
        if key.device.type == 'cpu' and action in (Action.CREATE, Action.DESTROY):
            live += size if action == Action.CREATE else -size
            peak = max(peak, live)
    return peak
