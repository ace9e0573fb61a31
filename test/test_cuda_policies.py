"""Dict observations, the chunked (LeRobot-shaped) adapter and the flight recorder on the CUDA
graph path, on the GPU machine (no ROS needed):

    FLASHRT_REQUIRE_CUDA=1 python3 -m pytest -q -m cuda test/test_cuda_policies.py

The CPU suite proves the semantics (test_chunked.py, test_dict_obs.py, test_flight.py); these
prove that the captured graphs keep them: the images are uploaded and converted inside the graph,
infer and queue ticks are both captured, and restore, branch and rewind replay bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.policies.chunked import ChunkedPolicy

pytestmark = pytest.mark.cuda

TOL = 1e-4  # fused (inductor) kernels against eager ones: float32 reassociation only


def lerobot_like(seed: int = 0):
    from test import lerobot_like as ll

    torch.manual_seed(seed)
    return ChunkedPolicy(ll.LeRobotLike())


def builtin(spec: str):
    kw = {"num_inference_steps": 2} if spec == "builtin:diffusion" else {}
    return load_policy(spec, **kw)


POLICIES = {
    "lerobot_like": lerobot_like,
    "builtin:act": lambda: builtin("builtin:act"),
    "builtin:diffusion": lambda: builtin("builtin:diffusion"),
}
# builtin:act as the node serves it (its default: fused, checked at build); the diffusion UNet
# captures its eager kernels here to keep the GPU run short (bench/policies_bench.py times both),
# and the test module counts its calls in a Python int, which dynamo guards on (a new variant per
# traced call)
FUSE = {"lerobot_like": False, "builtin:act": None, "builtin:diffusion": False}  # None: its default


def stream(eng: Engine, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    spec = eng.observation_spec()
    out = []
    for _ in range(n):
        obs = {}
        for key, v in spec.items():
            if v["kind"] == "vector":
                obs[key] = (rng.normal(size=v["shape"]) * 0.3).astype(np.float32)
            else:
                obs[key] = rng.integers(0, 256, v["shape"], dtype=np.uint8)
        out.append(obs)
    return out


def run(eng: Engine, obs: list[dict], session: str = "main") -> np.ndarray:
    return np.array([eng.step(o, session=session) for o in obs])


@pytest.mark.parametrize("name", list(POLICIES))
def test_captured_ticks_match_eager_and_restore_branch_rewind_replay_bitwise(name):
    graph = Engine(POLICIES[name](), device="cuda", seed=3, flight_ticks=16, fuse=FUSE[name])
    eager = Engine(POLICIES[name](), device="cuda", seed=3, use_graph=False)
    assert graph.session("main").captured
    if FUSE[name] is None:  # builtin:act ensembles: its compiled step passes the check now
        assert graph.fuse and graph.fused_mismatch == ""
    obs = stream(graph, 24)
    want = run(eager, obs)
    got = run(graph, obs[:6])
    cap = graph.checkpoint(name="mid")
    got = np.concatenate([got, run(graph, obs[6:])])
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)  # infer and queue ticks alike

    graph.restore(cap.id)  # history, queue, cursor and noise come back with the arena
    assert np.array_equal(run(graph, obs[6:]), got[6:])
    graph.branch(cap.id, "alt")
    assert np.array_equal(run(graph, obs[6:], session="alt"), got[6:])
    assert graph.rewind(7) == len(obs) - 7  # the ring is written inside the captured step
    assert np.array_equal(run(graph, obs[-7:]), got[-7:])


class HostZeros(torch.nn.Module):
    """LeRobot's ACT makes its latent as torch.zeros(...).to(device): a tensor made on the host,
    copied to the device from pageable memory, which CUDA graph capture refuses."""

    def __init__(self, coeff: float | None = None):
        from test import lerobot_like as ll

        super().__init__()
        self.config = ll.Config(
            input_features=ll.features(),
            output_features={"action": ll.PolicyFeature(ll.FeatureType.ACTION, (ll.ACTION_DIM,))},
            n_obs_steps=1,
            n_action_steps=4 if coeff is None else 1,
            temporal_ensemble_coeff=coeff,
        )
        g = torch.Generator().manual_seed(2)
        self.w = torch.nn.Parameter(torch.randn(ll.STATE_DIM + 4, 6 * ll.ACTION_DIM, generator=g))

    def predict_action_chunk(self, batch: dict) -> torch.Tensor:
        dev = batch["observation.state"].device
        feats = torch.cat(
            [
                batch["observation.state"],
                batch["observation.images.top"].mean((-1, -2)),
                batch["observation.images.wrist"].mean((-1, -2)),
            ],
            -1,
        )
        bias = torch.zeros([1, 6, 3], dtype=torch.float32).to(dev) + 0.5  # made on the host
        return torch.tanh(feats @ self.w).view(1, 6, 3) + bias


@pytest.mark.parametrize("coeff", [None, 0.01])
@pytest.mark.parametrize("fuse", [False, True])
def test_a_step_that_makes_host_tensors_is_captured_on_the_device(fuse, coeff):
    """Unfused, capture runs with the device as the default device; fused, inductor moves the
    constructor there. Fused, the queue ticks read the cursor before the counter moves (the
    counter is advanced outside the compiled step; test_fusecheck.py), and with temporal
    ensembling the compiled step passes the check (the sums are shifted by after_step)."""
    graph = Engine(ChunkedPolicy(HostZeros(coeff)), device="cuda", seed=3, fuse=fuse)
    assert graph.fuse == fuse and graph.fused_mismatch == ""
    eager = Engine(ChunkedPolicy(HostZeros(coeff)), device="cuda", seed=3, use_graph=False)
    assert graph.session("main").captured
    obs = stream(graph, 10)
    np.testing.assert_allclose(run(graph, obs), run(eager, obs), rtol=0, atol=TOL)


def test_warming_the_next_tick_changes_no_action(monkeypatch):
    """Engine._warm (an infer tick re-checks its observation and uploads the next kind's graph
    while the device runs, and with "after" once more when it is done): the same actions to the
    bit with it and without it."""
    import flashrt_ros.runtime.engine as engine_mod

    calls = []
    warm_fn = engine_mod.Engine._warm

    def counted(self, *a):
        calls.append(a[-1])
        return warm_fn(self, *a)

    monkeypatch.setattr(engine_mod.Engine, "_warm", counted)
    got = {}
    for warm in [("check", "upload"), ("check", "upload", "after"), ()]:
        monkeypatch.setattr(engine_mod, "WARM_NEXT", warm)
        eng = Engine(builtin("builtin:diffusion"), device="cuda", seed=1, fuse=False)
        assert eng.policy.tick_kinds[1] == "queue"
        assert eng.session("main").plans[1].upload()  # the upload is there to be used
        calls.clear()
        got[warm] = run(eng, stream(eng, 24))  # infer, queue and record ticks
        assert eng._warming
        # with it on, the infer and record ticks warmed (unless the device was already done)
        assert bool(calls) == bool(warm), calls
        # "after" warms every tick that staged inputs, whether or not the device was done
        assert ("check", "upload") in calls if "after" in warm else True, calls
    assert np.array_equal(got[("check", "upload")], got[()])
    assert np.array_equal(got[("check", "upload", "after")], got[()])


@pytest.mark.parametrize("top", ["rgb8", "bgr8"])
@pytest.mark.parametrize("wrist", ["rgb8", "mono8"])
def test_images_are_uploaded_and_converted_inside_the_graph(top, wrist):
    from test import lerobot_like as ll

    enc = {"observation.images.top": top, "observation.images.wrist": wrist}
    stats = load_policy("test.lerobot_like:make_stats")
    eng = Engine(stats, device="cuda", image_encodings=enc, fuse=False)
    assert eng.session("main").captured
    rng = np.random.default_rng(1)
    for _ in range(3):  # fresh images each tick: nothing stale is read from the device buffers
        img = rng.integers(0, 256, (*ll.TOP_HW, 3), dtype=np.uint8)
        w = rng.integers(0, 256, ll.WRIST_HW if wrist == "mono8" else (*ll.WRIST_HW, 3))
        w = w.astype(np.uint8)
        a = eng.step(
            {
                "observation.state": np.zeros(4),
                "observation.images.top": img,
                "observation.images.wrist": w,
            }
        )
        want = ll.expected_stats(img, w, top, wrist)
        np.testing.assert_allclose(a, want, rtol=0, atol=1e-5)


def test_chunked_ticks_allocate_nothing():
    eng = Engine(lerobot_like(), device="cuda", seed=0)
    obs = stream(eng, 64)
    run(eng, obs[:16])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    acts = run(eng, obs * 8)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert np.isfinite(acts).all()


def test_an_image_staged_once_is_not_copied_again_while_it_is_the_same_immutable_array():
    """A camera image decoded in place is a view over the message's bytes: while the node hands
    the same one to each step (a 30 Hz camera, a 500 Hz loop) it stays in the pinned staging
    buffer and is not copied again; a new frame is, and so is a writable array every time, its
    changes in place included. The steps see the right pixels throughout."""
    from test import lerobot_like as ll

    eng = Engine(load_policy("test.lerobot_like:make_stats"), device="cuda", fuse=False)
    inputs = eng.session("main").inputs
    rng = np.random.default_rng(5)

    def frame(shape) -> np.ndarray:  # as node/cameras.py decodes a message: a view over bytes
        raw = rng.integers(0, 256, shape, dtype=np.uint8).tobytes()
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape)

    top, wrist = frame((*ll.TOP_HW, 3)), frame((*ll.WRIST_HW, 3))

    def step(t, w) -> None:
        obs = {"observation.state": np.zeros(4), "observation.images.top": t}
        a = eng.step({**obs, "observation.images.wrist": w})
        np.testing.assert_allclose(a, ll.expected_stats(t, w, "rgb8", "rgb8"), rtol=0, atol=1e-5)

    n = inputs.copies
    step(top, wrist)
    assert inputs.copies == n + 3  # the state and both images
    for _ in range(3):
        step(top, wrist)
    assert inputs.copies == n + 3 + 3  # the state only
    top = frame((*ll.TOP_HW, 3))  # a new frame
    step(top, wrist)
    assert inputs.copies == n + 6 + 2
    w = np.array(wrist)  # writable: copied every time
    step(top, w)
    w[:] = 255 - w
    step(top, w)
    assert inputs.copies == n + 8 + 4


def test_a_prestaged_image_is_not_copied_by_the_step_that_uses_it():
    """Engine.prestage (the node calls it when an image arrives) copies an immutable image into
    the pinned staging buffer between steps; the next step given that array copies only the
    rest and sees the right pixels. A writable array is not kept (False, nothing copied), and
    a frame prestaged and then superseded by another in the step is staged by the step."""
    from test import lerobot_like as ll

    eng = Engine(load_policy("test.lerobot_like:make_stats"), device="cuda", fuse=False)
    inputs = eng.session("main").inputs
    rng = np.random.default_rng(7)

    def frame(shape) -> np.ndarray:
        raw = rng.integers(0, 256, shape, dtype=np.uint8).tobytes()
        return np.frombuffer(raw, dtype=np.uint8).reshape(shape)

    def step(t, w) -> None:
        obs = {"observation.state": np.zeros(4), "observation.images.top": t}
        a = eng.step({**obs, "observation.images.wrist": w})
        np.testing.assert_allclose(a, ll.expected_stats(t, w, "rgb8", "rgb8"), rtol=0, atol=1e-5)

    top, wrist = frame((*ll.TOP_HW, 3)), frame((*ll.WRIST_HW, 3))
    n = inputs.copies
    assert eng.prestage("observation.images.top", top) is True
    assert eng.prestage("observation.images.wrist", wrist) is True
    assert inputs.copies == n + 2
    step(top, wrist)
    assert inputs.copies == n + 3  # the state only
    assert eng.prestage("observation.images.top", np.array(top)) is False  # writable
    assert inputs.copies == n + 3
    eng.prestage("observation.images.top", frame((*ll.TOP_HW, 3)))  # superseded before a step
    newer = frame((*ll.TOP_HW, 3))
    step(newer, wrist)
    assert inputs.copies == n + 4 + 2  # prestage, then the state and the newer frame
