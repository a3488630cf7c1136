"""Placement on a simulated cluster of 2 nodes x 8 fake GPUs (`ray.cluster_utils.Cluster` on loopback with token auth,
its own temp dir, in a driver process of its own so it never meets the session's private Ray): the split and colocated
plans checked from inside real actors, 17 GPUs refused at once, every GPU free again after `remove`."""

import json, os, subprocess, sys, tempfile, time, uuid
from pathlib import Path
import pytest
from test_controller import stop_session

ROOT = Path(__file__).resolve().parents[1]
GPUS = 16


class Probe:
    "A tiny actor that says where it runs"

    def where(self):
        import ray  # Ray's own answers, not molt_nb's `where` (and no molt_nb import in 16 fresh processes)

        gpus = [int(g) for g in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), gpus, os.environ.get('CUDA_VISIBLE_DEVICES')

    def molt_where(self):
        from molt_nb.placement import where

        return where()


def free_gpus(ray, want: float, within: float = 15) -> float:
    "The cluster's free GPUs once they reach `want`, or what they are after `within` seconds"
    end = time.monotonic() + within
    while (free := ray.available_resources().get('GPU', 0)) < want and time.monotonic() < end:
        time.sleep(0.1)
    return free


def place(ray, shape, plan) -> dict:
    "Start one Probe per slot of `plan`, ask each where it runs, check it, then kill them all and remove the groups"
    from molt_nb.placement import Placement, PlacementError, Where

    placement = Placement(plan, shape)
    probe = ray.remote(Probe)
    actors = {(s.role, s.index): probe.options(**placement.options(s.role, s.index)).remote() for s in plan.slots}
    answers = ray.get([a.where.remote() for a in actors.values()], timeout=180)
    nodes = [n.node_id for n in shape.nodes]
    seen, refused = {}, []
    for (role, index), (node_id, gpus, visible) in zip(actors, answers):
        seen[f"{role} {index}"] = dict(node=nodes.index(node_id), gpus=gpus, visible=visible)
        try:
            placement.check(role, index, Where(node_id, tuple(gpus)))
        except PlacementError as e:
            refused.append(str(e))
    held = ray.available_resources().get('GPU', 0)
    second = time.monotonic()
    try:  # a second run while this one holds its GPUs
        Placement(plan, shape).remove()
        second = dict(error=None)
    except PlacementError as e:
        second = dict(error=str(e), seconds=time.monotonic() - second)
    for a in actors.values():
        ray.kill(a)
    placement.remove()
    placement.remove()  # twice is fine
    return dict(seen=seen, refused=refused, held_free=held, second=second, free_after=free_gpus(ray, GPUS))


def oversubscribe(ray, shape) -> dict:
    "17 GPUs on 16: refused by `plan`, and by `Placement` for a plan made by hand, both before anything waits"
    from molt_nb.placement import Placement, PlacementError, Plan, Slot, cluster_shape, plan

    out = {}
    t = time.monotonic()
    try:
        plan(cluster_shape(), 'split', engines=9, trainer_ranks=8)
    except PlacementError as e:
        out['plan'] = dict(error=str(e), seconds=time.monotonic() - t)
    slots = [Slot('trainer', r, 0, (r,)) for r in range(8)] + [Slot('engine', e, 1, (e,)) for e in range(9)]
    t = time.monotonic()
    try:
        Placement(Plan('split', tuple(slots)), shape)
    except PlacementError as e:
        out['placement'] = dict(error=str(e), seconds=time.monotonic() - t)
    return out


def blocked(ray, shape) -> dict:
    "12 GPUs asked with 12 free, but 8 of them on a node that has 4 left: refused after `ready_s`, nothing kept"
    from molt_nb.placement import Placement, PlacementError, plan
    from ray.util.placement_group import placement_group_table

    holder = Placement(plan(shape, 'colocated', engines=4, trainer_ranks=4, cpus=0.5), shape)
    t = time.monotonic()
    try:
        Placement(plan(shape, 'split', engines=4, trainer_ranks=8, cpus=0.5), shape, ready_s=1)
        out = dict(error=None)
    except PlacementError as e:
        out = dict(error=str(e), seconds=time.monotonic() - t)
    holder.remove()
    out['free_after'] = free_gpus(ray, GPUS)
    out['groups_left'] = [g for g in placement_group_table().values() if g['state'] != 'REMOVED']
    return out


def on_cpu(ray, shape) -> dict:
    "device 'cpu': no placement group, actors reserve nothing, all on node 0"
    from molt_nb.placement import Placement, Where, plan
    from ray.util.placement_group import placement_group_table

    before = len(placement_group_table())
    placement = Placement(plan(shape, 'split', engines=1, trainer_ranks=1, device='cpu'), shape)
    options = placement.options('engine', 0)
    actor = ray.remote(Probe).options(**options).remote()
    node_id, gpus, _ = ray.get(actor.where.remote(), timeout=120)
    agrees = ray.get(actor.molt_where.remote(), timeout=120) == Where(node_id, tuple(gpus))
    placement.check('engine', 0, Where(node_id, tuple(gpus)))  # raises if it is not where the plan says
    ray.kill(actor)
    return dict(
        groups=len(placement_group_table()) - before,
        cpus=options['num_cpus'],
        node=[n.node_id for n in shape.nodes].index(node_id),
        gpus=gpus,
        agrees=agrees,
    )


def scenario(f, *args) -> dict:
    "What `f` saw, or why it crashed (the other scenarios still run)"
    try:
        return f(*args)
    except Exception as e:
        return dict(crashed=f"{type(e).__name__}: {e}")


def drive(temp_dir: str) -> dict:
    "Start the simulated cluster, run every scenario, stop the cluster"
    import ray
    from ray.cluster_utils import Cluster
    from molt_nb.placement import cluster_shape, plan

    node = dict(node_ip_address='127.0.0.1', num_cpus=8, num_gpus=8)
    t = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args=node | dict(temp_dir=temp_dir, include_dashboard=False))
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address, logging_level='ERROR', log_to_driver=False)
        cluster.wait_for_nodes()
        out = dict(start_s=time.monotonic() - t)
        shape = cluster_shape()
        out['shape'] = [(n.gpus, n.cpus) for n in shape.nodes]
        out['oversubscribe'] = scenario(oversubscribe, ray, shape)
        out['split'] = scenario(place, ray, shape, plan(shape, 'split', engines=8, trainer_ranks=8, cpus=0.5))
        out['split_s'] = time.monotonic() - t
        out['colocated'] = scenario(place, ray, shape, plan(shape, 'colocated', engines=4, trainer_ranks=4, cpus=0.5))
        out['colocated_s'] = time.monotonic() - t
        out['blocked'] = scenario(blocked, ray, shape)
        out['cpu'] = scenario(on_cpu, ray, shape)
        out['free_end'] = free_gpus(ray, GPUS)
        out['end_s'] = time.monotonic() - t
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope='module')
def seen():
    """What the driver saw on the simulated cluster. Its processes stop with the driver (its own shutdown; Ray's
    processes also follow their parent); any left are killed by pid, never with `ray stop`"""
    tmp = tempfile.mkdtemp(prefix='molt-pl-')  # short: Ray's socket paths must fit in 107 bytes
    os.makedirs(f"{tmp}/ray")
    env = os.environ | dict(
        PYTHONPATH=str(ROOT),
        RAY_TMPDIR=tmp,  # Cluster writes ray_current_cluster under it, not under the shared /tmp/ray
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER='0',  # every process on 127.0.0.1 only (issue 15)
        RAY_AUTH_MODE='token',
        RAY_AUTH_TOKEN=uuid.uuid4().hex,
        RAY_USAGE_STATS_ENABLED='0',
    )
    for k in ('RAY_ADDRESS', 'RAY_AUTH_TOKEN_PATH'):
        env.pop(k, None)
    try:
        for _ in range(3):  # Ray waits a fixed 30 s for a raylet, which a loaded 2-core machine can miss: start again
            p = subprocess.run(
                [sys.executable, __file__, f"{tmp}/ray"], env=env, capture_output=True, text=True, timeout=400
            )
            if p.returncode == 0 or 'timed out during startup' not in p.stderr:
                break
            stop_session([tmp])
        assert p.returncode == 0, p.stderr[-4000:]
        yield json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        stop_session([tmp])


def test_split_packs_ranks_in_order_and_engines_on_the_other_node(seen):
    split = seen['split']
    assert seen['shape'] == [[8, 8.0], [8, 8.0]]
    ranks = [split['seen'][f"trainer {r}"] for r in range(8)]
    engines = [split['seen'][f"engine {e}"] for e in range(8)]
    assert [(x['node'], x['gpus']) for x in ranks] == [(0, [r]) for r in range(8)], ranks
    assert [(x['node'], x['gpus']) for x in engines] == [(1, [e]) for e in range(8)], engines
    assert [x['visible'] for x in ranks] == [str(r) for r in range(8)]  # what a CUDA process would see
    assert split['refused'] == []  # Placement.check agrees with what the actors saw
    assert split['held_free'] == 0


def test_colocated_pairs_rank_and_engine_on_one_gpu(seen):
    got = seen['colocated']['seen']
    pairs = [(got[f"trainer {i}"], got[f"engine {i}"]) for i in range(4)]
    assert all((t['node'], t['gpus']) == (e['node'], e['gpus']) for t, e in pairs), pairs
    assert [(t['node'], t['gpus']) for t, _ in pairs] == [(0, [i]) for i in range(4)], pairs
    assert seen['colocated']['refused'] == []


def test_oversubscription_fails_fast_naming_both_numbers(seen):
    over = seen['oversubscribe']
    assert set(over) == {'plan', 'placement'}, over
    for where, got in over.items():
        assert got['seconds'] < 1, (where, got)
        assert '17 GPUs' in got['error'] and '16' in got['error'], got
    assert 'the cluster has 16 (2 nodes x 8)' in over['plan']['error']
    busy = seen['split']['second']  # a second run while the first holds every GPU
    assert busy['error'] and 'needs 16 GPUs, 0 of' in busy['error'] and busy['seconds'] < 1, busy


def test_a_node_without_room_is_refused_and_nothing_kept(seen):
    got = seen['blocked']
    assert got['error'] and 'not ready within 1 s' in got['error'], got
    assert got['seconds'] < 10, got
    assert got['groups_left'] == [] and got['free_after'] == GPUS, got


def test_remove_frees_every_gpu(seen):
    assert seen['split']['free_after'] == GPUS
    assert seen['colocated']['free_after'] == GPUS
    assert seen['free_end'] == GPUS


def test_cpu_needs_no_group_and_reserves_nothing(seen):
    assert seen['cpu'] == dict(groups=0, cpus=0, node=0, gpus=[], agrees=True)


@pytest.mark.parametrize('device', ['cuda', 'cpu'])
def test_a_shape_without_nodes_gpus_or_with_negative_counts_is_refused(device):
    "`plan` refuses an empty shape (it gave a TypeError on 'cuda', slots on a node 0 that is not there on 'cpu')"
    from molt_nb.placement import ClusterShape, NodeShape, PlacementError, plan

    for nodes in (0, -1):
        with pytest.raises(PlacementError, match='the cluster has no nodes: a plan needs at least one'):
            plan(ClusterShape.uniform(nodes, 8), 'split', 1, 1, device=device)
    with pytest.raises(PlacementError, match=r'node 1 \(node1\) has -8 GPUs'):
        plan(ClusterShape((NodeShape('node0', 0, 8), NodeShape('node1', -8, 8))), 'split', 1, 1, device=device)
    with pytest.raises(PlacementError, match='has 0 GPUs and -1 CPUs'):
        plan(ClusterShape.uniform(1, 0, cpus=-1), 'split', 1, 1, device=device)
    if device == 'cuda':
        with pytest.raises(
            PlacementError, match=r"device 'cuda', but the widest node has 0 GPUs \(0 \(2 nodes x 0\)\)"
        ):
            plan(ClusterShape.uniform(2, 0), 'split', 1, 1, device=device)
    else:
        assert len(plan(ClusterShape.uniform(1, 0), 'split', 1, 1, device=device).slots) == 2


if __name__ == '__main__':  # the driver: one process of its own, connected to the simulated cluster only
    print(json.dumps(drive(sys.argv[1])))
