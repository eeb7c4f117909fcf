"""`--target cuda` modules under numba-cuda's simulator, against the CPU target (float64).

The simulator must be on before numba is imported, so tests/cuda_target_runs.py runs in two
subprocesses at once: the model zoo; and the Trainer, device arrays and the CUDA-graph path. The
simulator has no graphs, so that path runs with the driver's stream capture simulated (recorded
launches, replayed). Shapes are tiny: the simulator runs every GPU thread in Python."""
import json
import os
import subprocess
import sys

import pytest
from conftest import cuda_env

pytest.importorskip("numba.cuda", reason="numba-cuda (the test extra) is not installed")
pytestmark = pytest.mark.slow

RUNS = os.path.join(os.path.dirname(__file__), "cuda_target_runs.py")
TOLERANCE = 1e-12   # relative: the same float64 arithmetic in another order


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = cuda_env()
    procs = {what: subprocess.Popen([sys.executable, RUNS, what, str(tmp_path_factory.mktemp(what))], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for what in ("models", "trainer", "bppsa")}
    out = {}
    for what, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        assert proc.returncode == 0, stderr[-4000:]
        out[what] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_every_entry_point_matches_the_cpu_target(results):
    models = results["models"]["zoo"]
    assert {"cg_mlp", "cg_shared", "cg_reduce3", "cg_user", "cg_scalars", "cg_layout", "cg_mask"} <= set(models)
    # gc.scan: reverse=True, two carries, a scan over a scan's ys, a scan in a scan's step, a loss of (T, B, C) logits
    assert {"cg_scan_rnn", "cg_scan_gru", "cg_scan_stacked", "cg_scan_nested", "cg_scan_seq_loss"} <= set(models)
    assert all({"forward", "loss", "grads", "input_grads"} <= set(e) for e in models.values())
    assert {m for m, e in models.items() if "hvp" in e} == {"cg_mlp", "cg_shared", "cg_reduce3", "cg_scalars",
                                                            "cg_scan_rnn", "cg_scan_gru", "cg_scan_stacked",
                                                            "cg_scan_nested", "cg_scan_seq_loss"}
    assert "hessian" in models["cg_scalars"]
    bad = {(m, k): v for m, e in models.items() for k, v in e.items() if not v <= TOLERANCE}
    assert not bad, bad


def test_bppsa_on_cuda_matches_the_interpreter(results):
    """--scan-backward bppsa: the maps, sweeps and adjoints as kernels; the same gradients and HVPs."""
    r = results["bppsa"]
    assert set(r["errors"]) == {"bp_rnn T=1", "bp_rnn T=5", "bp_mixing T=4", "bp_stacked T=3", "bp_gru T=3"}
    assert "hvp" in r["errors"]["bp_rnn T=5"]
    assert r["kernels"]["bp_rnn"] == ["bppsa_compose_pairs", "bppsa_push_adjoints", "bppsa_tanh_jacobians"]
    assert r["kernels"]["bp_gru"] == ["bppsa_compose_pairs", "bppsa_push_adjoints"]   # dense: by basis vectors
    bad = {(m, k): v for m, e in r["errors"].items() for k, v in e.items() if not v <= TOLERANCE}
    assert not bad, bad


def test_random_programs_with_scans_match_torch_on_cuda(results):
    """The fuzzer's programs (random cells, a reverse scan) on CUDA, reverse and BPPSA backward."""
    assert results["bppsa"]["fuzz"] == {"reverse": None, "bppsa": None}, results["bppsa"]["fuzz"]


def test_cuda_gradients_match_finite_differences(results):
    assert results["trainer"]["fd"] < 1e-7


def test_cuda_trainer_matches_the_cpu_trainer_and_resumes(results):
    r = results["trainer"]
    for optimizer in ("sgd", "adam"):
        assert r[f"{optimizer}_losses"] <= 1e-12 and r[f"{optimizer}_params"] <= TOLERANCE
        assert r[f"{optimizer}_resumed"] <= 1e-12


def test_streamed_backward_hands_each_gradient_over_after_its_kernels(results):
    """parallel="data" on CUDA: each bucket's copy and reduction start as the backward goes on."""
    streamed = results["trainer"]["streamed"]
    assert set(streamed) == {"mlp", "scalars", "shared"}
    for name, r in streamed.items():
        assert r["error"] <= TOLERANCE and r["weight"] == 1.0, (name, r)
        assert r["once"] and r["last_first"], (name, r)


def test_lr_grad_and_its_trainer_match_the_cpu_target(results):
    """The same noise from the same seed in the kernels: the same estimate, MLP, scan and embeddings alike."""
    lr = results["trainer"]["lr"]
    assert set(lr) == {"mlp_antithetic", "mlp_layerwise", "trainer", "trainer_resumed", "scan_device_inputs",
                       "scan_step_loss", "embeddings", "dropout", "layer_norm", "scan_of_a_scaled_weight",
                       "gcn_neighbours", "uncertainty_weighted", "conv_rnn", "nested_scan", "bn_conv", "time_major",
                       "folded_conv", "clip", "mean_image_conv"}
    off = {k: v for k, v in lr.items() if not (isinstance(v, float) and v <= TOLERANCE)}
    assert not off, off   # (only those: pytest cuts a long dict short)


def test_device_arrays_in_and_out(results):
    r = results["trainer"]
    assert r["device_inputs"] <= TOLERANCE
    device_array = "DeviceNDArray" if os.environ.get("GRADC_TEST_ON_GPU") == "1" else "FakeCUDAArray"
    assert r["device_outputs_type"] == [device_array] and r["device_outputs"] == 0.0


def test_scalar_params_train_checkpoint_and_forward(results):
    assert results["trainer"]["scalar_param"] <= 1e-12


def test_a_step_that_is_not_finite_changes_nothing(results):
    r = results["trainer"]
    assert r["nonfinite"] == "raised" and r["nonfinite_unchanged"] == 0.0 and r["nonfinite_steps"] == 0


def test_device_inputs_are_checked_by_name(results):
    shape, label, step = results["trainer"]["refusals"]
    assert "input 'x' has shape (6, 4), expected (B, 5)" in shape
    # device labels are checked when the kernels' guard turns a bad one into a NaN loss
    assert "loss_and_grad: input 'y' holds 7 at [0], outside 0..2" in label
    assert "Trainer.step: input 'y' holds -1 at [0], outside 0..2" in step
    assert results["trainer"]["label_step_unchanged"] == 0.0


def test_a_wrong_array_assigned_into_the_trainer_is_refused_and_undone(results):
    wrong, missing = results["trainer"]["assigned"]
    assert "got a float" in wrong and "array of shape (1, 1); it holds the trainer's own values again" in wrong
    assert "params ['W0'] were missing (they hold the trainer's own values again)" in missing


def test_graph_path_captures_once_per_shape_and_replays(results):
    """The runner's CUDA-graph path: the driver's stream capture simulated (FakeGraphs), or real on a GPU."""
    r = results["trainer"]["graphs"]
    assert r["graph_error"] is None
    assert r["captures"] == 2 and r["replays"] == 5    # batches 6, 6, 6, 4, 6, 6 (device), 6: two shapes, five repeats
    assert r["loss_and_grad"] <= TOLERANCE                  # new inputs reach the captured buffers
    assert r["trainer_replays"] == 3 and r["trainer_losses"] <= 1e-12   # 4 steps: one capture, 3 replays
    assert r["trainer_params"] <= TOLERANCE


def test_a_refused_capture_runs_those_calls_directly_and_keeps_the_other_graphs(results):
    """CuPy refuses cuBLAS while a graph is captured: one refusal must not turn graphs off for every call."""
    r = results["trainer"]["graphs"]
    assert r["refused"] <= TOLERANCE and r["still_on"]
    assert r["refused_direct"] == 1 and "cuBLAS" in r["refused_error"]
    assert r["refused_captured"] == 4   # batches 6 and 4 before, 5 now, and the Trainer's step


def test_a_captured_graph_holds_the_temporaries_it_writes(results):
    """A scan's carries and work space, made while its graph is captured, live as long as the graph:
    replays stay right, and arrays made after numba's frees do not get their memory."""
    r = results["trainer"]["graphs"]
    assert r["scan_temporaries_held"] >= 4   # work, scal, the carry's two buffers
    assert r["scan_replays"] <= TOLERANCE and r["others_untouched"]


def test_pipelines_on_virtual_devices_match_one_device(results):
    """--devices K --microbatches M on one GPU: every schedule, unequal microbatches, weight decay."""
    r = results["models"]["pipelines"]
    for key in ("K2 gpipe M3", "K2 1f1b M2", "K3 sequential M2"):
        assert r[key] <= 1e-12, (key, r[key])
    assert r["K3 sequential M2 devices"] == ["cuda:0", "cuda:1", "cuda:2"]
    assert r["trainer"] <= 1e-12 and r["trainer_params"] <= TOLERANCE
    # the estimate runs whole, in a plain and in a data-parallel Trainer
    assert r["lr_grad"] <= TOLERANCE and r["lr_trainer"] <= TOLERANCE and r["lr_trainer_data_parallel"] <= TOLERANCE


def test_one_stage_per_gpu_matches_one_device(results):
    """--devices 2 with 2 GPUs (the simulator given 3): stage k on GPU k through a runner of its own,
    the module's runner on GPU 0 holding the trained state, values crossing GPUs only after the
    receiving GPU's stream waited on an event recorded on the sending GPU's."""
    r = results["models"]["pipelines"]["gpus"]
    if os.environ.get("GRADC_TEST_ON_GPU") == "1":
        pytest.skip("on a real GPU: this test fakes 3 GPUs, which only the simulator can")
    assert r["error"] <= 1e-12
    assert r["runners"] == [[0, True], [1, False]] and r["held"] == ["cuda:0", "cuda:1"]
    assert r["crossings"] == [[0, 1], [1, 0]] and r["events"] % 2 == 0
    chosen = r["chosen"]
    assert chosen["virtual"] == [0, 0] and chosen["1,0"] == [1, 0]
    assert "GRADC_STAGE_GPUS='0,5': give 2 GPU numbers below 3" in chosen["0,5"] and "give 2" in chosen["0"]


def test_cublas_path_gives_the_same_values(results):
    """cuBLAS (CuPy simulated) for the products, the epilogue kernels after: every transpose the
    backward needs, and the fused bias, activation and weight decay."""
    r = results["trainer"]["library"]
    assert r["error"] <= TOLERANCE
    assert r["calls"] >= 5 and {"(False, False)", "(False, True)", "(True, False)"} <= set(r["transposes"])


def test_split_k_products_give_the_same_values(results):
    """Few output tiles and a long K dim: the products in slices, added in a fixed order, then the
    epilogue; backprop, lr_grad's K*B rows, and a scan's weight gradients over every step's rows."""
    r = results["trainer"]["split"]
    assert all(r[k] <= TOLERANCE for k in ("mlp", "mlp_lr", "rnn_lr")), r
    # both weight gradients over 40 rows in 2 slices; lr_grad's over (8 + 2) x 40 rows in 25 (8 noised copies of
    # the batch and two without noise, for the pairs' baseline); the RNN's over 6 x 4 x 8
    # (on a GPU each product runs twice: the first call, then its capture)
    splits = r["splits"]
    assert len(splits["mlp"]) in (2, 4) and set(splits["mlp"]) == {2}, splits
    assert 25 in splits["mlp_lr"] and max(splits["rnn_lr"]) >= 2, splits
