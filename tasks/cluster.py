"""Rollouts and grading on a Ray cluster (a run's `cluster.address` set).

The driver (the flow run) keeps everything it had: the step loop, the vLLM servers'
weight sync, the store's tables, partial commits, progress. Only the per-item work moves:

- an episode runs `tasks.rollout.run_one` (one agent loop, its own sandbox, its own
  PolicyClient over every live vLLM server) in the EpisodeRunner actor of a node, the one
  with the fewest episodes in flight, and returns its trajectory row stamped with the node id;
- a grading is one Ray task that runs `tasks.grading.grade_patch` and returns its result,
  stamped the same way.

Faults: an episode whose runner died (its node lost) goes to another node's runner, and Ray
re-runs a grading whose worker or node died (`cluster.max_task_retries` times, system failures
only); the driver keys rows by rollout id, so a re-run replaces nothing and loses nothing. Work
still lost after the retries becomes an infra_error row (masked downstream, as a sandbox that
never started), never a missing one. Errors of the episode itself
(the inference servers gone for good, a bug) travel back as they would in-process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading

# Environment the driver's settings live in (cache folders, the vLLM python): workers get it too.
_PASSED_ENV_PREFIXES = ("RLVR_",)
_connect_lock = threading.Lock()


def connect(cluster) -> None:
    """Join the Ray cluster at `cluster.address` once per process (a later call is a no-op)."""
    import ray

    with _connect_lock:
        if ray.is_initialized():
            return
        env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ENV_PREFIXES)}
        main = threading.current_thread() is threading.main_thread()
        sigterm = signal.getsignal(signal.SIGTERM) if main else None
        # Workers' prints stay in the cluster's logs: the run's own progress lines stay readable.
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env} if env else None)
        if sigterm is not None:  # ray.init makes SIGTERM a bare sys.exit: keep the run's clean stop (flows/main.py)
            signal.signal(signal.SIGTERM, sigterm)


def _grading_options(cluster, sandbox_backend: str) -> dict:
    opts = dict(num_cpus=cluster.grading_cpus, max_retries=cluster.max_task_retries, retry_exceptions=False,
                # Over the nodes, not packed on the driver's: what a cluster is for.
                scheduling_strategy="SPREAD")
    if cluster.sandbox_resources:
        opts["resources"] = {f"sandbox_{sandbox_backend}": 1}
    return opts


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _is_lost(e: BaseException) -> bool:
    """A Ray system failure (worker, node or object lost past the retries), not the task's own error."""
    import ray

    return (isinstance(e, ray.exceptions.RayError)
            and not isinstance(e, (ray.exceptions.RayTaskError, ray.exceptions.TaskCancelledError)))


def _own_error(e: BaseException) -> BaseException:
    """The task's own exception, as raised in the worker (InferenceDown, ServerMismatchError, a bug)."""
    import ray

    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return e.cause
    return e


# -- rollouts --------------------------------------------------------------------------------
class EpisodeRunner:
    """An async Ray actor, one per node: it runs that node's episodes side by side in one event
    loop (an episode mostly waits on vLLM and on its sandbox), as the driver does in-process.
    A Ray task per episode instead started a Python process per episode: 5-8x slower here."""

    def __init__(self):
        self.shared_id, self.shared = None, None

    async def run(self, task: dict, sample: int, shared_box: list) -> dict:
        """One episode through tasks.rollout.run_one -> its row, stamped with this node's id.
        `shared_box` = [ObjectRef of the stage's shared tuple], fetched once per stage here."""
        from tasks.inference import PolicyClient
        from tasks.rollout import run_one

        ref = shared_box[0]
        if ref.hex() != self.shared_id:
            self.shared, self.shared_id = await ref, ref.hex()
        spec, urls, version, stop_token_ids, tokenizer, cfg, store = self.shared
        # Its own client: it stamps each turn with the version of the server that sampled it.
        async with PolicyClient(urls, stop_token_ids=stop_token_ids, version=version,
                                version_from_server=True) as client:
            row = await run_one(task, sample, spec, client, tokenizer, cfg, store)
        row["node"] = _node_id()
        return row


_runners: dict = {}  # (Ray job id, node id) -> that node's EpisodeRunner, kept from stage to stage


def episode_runners(cluster, sandbox_backend: str) -> dict:
    """{node id: EpisodeRunner} on every live node with CPUs (and, with `sandbox_resources`, the
    backend's sandbox resource). Started once per node; a node that left drops out, one that joined
    gets a runner. A runner holds no Ray resources: its episodes wait on vLLM and their sandboxes,
    and a held CPU would keep a one-CPU node from ever taking a grading."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    job = ray.get_runtime_context().get_job_id()
    need = ["CPU"] + ([f"sandbox_{sandbox_backend}"] if cluster.sandbox_resources else [])
    live = [n["NodeID"] for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(k, 0) > 0 for k in need)]
    for key in [k for k in _runners if k[0] != job or k[1] not in live]:
        del _runners[key]
    for node in live:
        if (job, node) not in _runners:
            _runners[(job, node)] = ray.remote(EpisodeRunner).options(
                num_cpus=0, max_concurrency=10_000,  # the driver bounds episodes in flight (agent.concurrency)
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    if not live:
        raise RuntimeError(f"no node of the Ray cluster at {cluster.address} can run episodes: none is alive "
                           f"with {' and '.join(need)} (ray status shows each node's resources)")
    return {node: _runners[(job, node)] for node in live}


class RayEpisodes:
    """tasks.rollout.collect's `episodes` on a Ray cluster: each episode goes to the node runner with the
    fewest episodes in flight; awaiting it gives its row. A runner lost with its node (or its
    process) is dropped and the episode sent to another, at most `max_task_retries` times; past
    that, or with no node left, the episode is an infra_error row."""

    def __init__(self, spec, client, tokenizer, cfg, store, say=print):
        import ray

        connect(cfg.cluster)
        self.spec, self.version, self.cluster, self.say = spec, client.version, cfg.cluster, say
        self.runners = episode_runners(cfg.cluster, cfg.sandbox.backend)
        self.in_flight = dict.fromkeys(self.runners, 0)
        # Put once, shared by every episode of the stage (the tokenizer and config are not small).
        self.shared = [ray.put((spec, client.live_urls, client.version, list(client.stop_token_ids), tokenizer,
                                cfg, store))]

    async def __call__(self, task: dict, sample: int) -> dict:
        import ray

        from tasks.rollout import infra_error_row

        lost = []
        while len(lost) <= self.cluster.max_task_retries:
            if not self.runners:
                lost.append("no live node can run episodes")
                break
            node = min(self.runners, key=self.in_flight.get)
            self.in_flight[node] += 1
            ref = self.runners[node].run.remote(task, sample, self.shared)
            try:
                return await asyncio.wrap_future(ref.future())
            except asyncio.CancelledError:
                ray.cancel(ref)  # another episode failed for good: stop this one too
                raise
            except ray.exceptions.RayActorError as e:  # the runner died (its node or process): try another
                lost.append(f"node {node[:12]}: {type(e).__name__}: {str(e)[:300]}")
                self.say(f"episode {task['instance_id']}/{sample}: its runner on node {node[:12]} is lost "
                         f"({type(e).__name__}); sent to another node")
                self.runners.pop(node, None)
                _runners.pop((ray.get_runtime_context().get_job_id(), node), None)  # the next stage starts a new one
            except Exception as e:
                if _is_lost(e):
                    lost.append(f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                raise _own_error(e) from None
            finally:
                self.in_flight[node] -= 1
        return infra_error_row(self.spec, task, sample, "ray: episode lost after retries: " + "; ".join(lost),
                               self.version)


# -- grading ---------------------------------------------------------------------------------
def _grade(fn, task_row: dict, patch: str, cfg, store):
    """Runs on a worker: one grading -> its GradeResult, with the node id."""
    res = fn(task_row, patch, cfg, store)
    res.node = _node_id()
    return res


class RayGrading(concurrent.futures.Executor):
    """The pool tasks.grading.grade_rollouts submits to: each grading a Ray task, its result a
    concurrent future. A grading lost after Ray's retries resolves as an infra_error result."""

    def __init__(self, cluster, sandbox_cfg, store):
        import ray

        connect(cluster)
        opts = _grading_options(cluster, sandbox_cfg.backend)
        need = {"CPU": cluster.grading_cpus, **opts.get("resources", {})}
        if not any(n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in ray.nodes()):
            # Ray would keep such a task pending forever.
            raise RuntimeError(f"no node of the Ray cluster at {cluster.address} can take a grading: none is alive "
                               f"with {need} (cluster.grading_cpus; ray status shows each node's resources)")
        self.fn = ray.remote(_grade).options(**opts)
        self.store = ray.put(store)
        self.refs: list = []

    def submit(self, fn, task_row, patch, cfg, store=None, cancel=None):
        # `cancel` (a threading.Event) stays here: shutdown(cancel_futures=True) cancels the tasks.
        from tasks.grading.grader import GradeResult

        ref = self.fn.remote(fn, task_row, patch, cfg, self.store)
        self.refs.append(ref)
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(f):
            try:
                out.set_result(f.result())
            except BaseException as e:
                if _is_lost(e):
                    out.set_result(GradeResult(reward=None, grading_status="infra_error",
                                               error=f"infra_error: ray: grading lost after retries: "
                                                     f"{type(e).__name__}: {str(e)[:500]}"))
                else:
                    out.set_exception(_own_error(e))

        ref.future().add_done_callback(done)
        return out

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        import ray

        if cancel_futures:
            for ref in self.refs:
                try:
                    ray.cancel(ref)
                except Exception:
                    pass
