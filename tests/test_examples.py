"""The examples, in quick mode, as a user runs them."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, tmp_path):
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)


def test_mlp_digits_quick(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs the 'examples' extra")
    r = run("mlp_digits.py", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    accuracy = float(r.stdout.split("test accuracy ")[1].split("%")[0]) / 100
    assert accuracy >= 0.95, r.stdout


@pytest.mark.slow
def test_residual_quick(tmp_path):
    r = run("residual.py", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validation objective" in r.stdout


@pytest.mark.slow
def test_curvature_digits_quick(tmp_path):
    pytest.importorskip("sklearn", reason="the digits examples need the 'examples' extra")
    r = run("curvature_digits.py", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "largest relative difference" in r.stdout


@pytest.mark.slow
def test_lenet_digits_quick(tmp_path):
    pytest.importorskip("sklearn", reason="the digits examples need the 'examples' extra")
    r = run("lenet_digits.py", tmp_path)
    assert r.returncode == 0 or "test accuracy" in r.stdout, r.stdout + r.stderr
    accuracy = float(r.stdout.split("test accuracy ")[1].split("%")[0]) / 100
    assert accuracy >= 0.95, r.stdout


@pytest.mark.slow
def test_bitstream_rnn_quick(tmp_path):
    """BPPSA's bitstream task, 5 epochs: well above chance (10%), below the best possible rule."""
    r = run("bitstream_rnn.py", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    accuracy = float(r.stdout.split("test accuracy ")[1].split("%")[0]) / 100
    best = float(r.stdout.split("best possible rule: ")[1].split("%")[0]) / 100
    assert 0.25 <= accuracy <= best + 0.03, r.stdout
