"""``brook up -f MANIFEST``: the shipped CPU example run on this machine (its model folder
given with ``--model``) answers the official ``openai`` client and drains on SIGTERM; its
engine configuration is the one the operator mounts into the pods, but for what only exists
outside a pod (asserted for every shipped example); what it cannot run is refused with the
field and the flag that fixes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import yaml
from tests.support import hub
from tests.support.engine_server import ServerProcess
from tests.support.examples import ROOT
from tests.support.ports import free_port

from brook_engine import LLM, SamplingParams
from brook_engine.config import ConfigError
from brook_operator.api import LLMInference
from brook_operator.cli import main
from brook_operator.local_run import LocalOptions, local_engine_config
from brook_operator.render import OperatorSettings
from brook_operator.render.config_map import pod_engine_config

EXAMPLES = sorted((ROOT / "crds" / "examples").glob("*.yaml"))


def _llmi(path: Path) -> LLMInference:
    return LLMInference.model_validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_local_configuration_is_the_pods_but_for_what_a_pod_alone_has(
    path: Path, tmp_path: Path
) -> None:
    llmi = _llmi(path)
    pod = pod_engine_config(llmi, OperatorSettings())
    key = tmp_path / "key"
    options = LocalOptions(model=tmp_path, port=8123, api_key_file=str(key), device="cpu")
    local = local_engine_config(llmi, options)
    assert local.model.uri == f"file://{tmp_path.resolve()}"
    assert local.model.model_copy(update={"uri": pod.model.uri}) == pod.model
    assert (local.server.host, local.server.port) == ("127.0.0.1", 8123)
    assert local.server.api_key is not None and local.server.api_key.file == str(key)
    unchanged = {"host": pod.server.host, "port": pod.server.port, "api_key": pod.server.api_key}
    assert local.server.model_copy(update=unchanged) == pod.server
    assert local.device == "cpu"
    same = {"model": pod.model, "server": pod.server, "device": pod.device}
    assert local.model_copy(update=same) == pod  # every engine section as the pod has it


def test_what_it_cannot_run_is_refused_with_the_fix(tmp_path: Path) -> None:
    remote = _llmi(ROOT / "crds" / "examples" / "qwen-110b-npu-tp4-pp2.yaml")
    with pytest.raises(ConfigError, match=r"spec\.model\.uri is 'pvc://.*give --model FOLDER"):
        local_engine_config(remote, LocalOptions())
    keyed = _llmi(ROOT / "crds" / "examples" / "llama-70b-npu-tp8.yaml")
    with pytest.raises(ConfigError, match=r"apiKeySecretRef.*--api-key-file"):
        local_engine_config(keyed, LocalOptions(model=tmp_path))


def test_what_only_a_cluster_applies_is_named(tmp_path: Path) -> None:
    """Nothing the manifest asks for is dropped without a word: each cluster-only field
    set gets its own note; a manifest with none gets none."""
    from brook_operator.local_run import cluster_only_notes

    example = _llmi(ROOT / "crds" / "examples" / "smollm2-cpu.yaml")  # an hf:// model
    bare = example.spec.model_dump(by_alias=True, exclude_none=True)
    bare = {k: v for k, v in bare.items() if k not in ("resources", "image", "scheduling")}
    bare["replicas"] = 1
    plain = LLMInference.model_validate({**example.model_dump(by_alias=True), "spec": bare})
    assert cluster_only_notes(plain, 1) == []
    resourced = _llmi(ROOT / "crds" / "examples" / "smollm2-cpu.yaml")  # 2 replicas, resources
    assert [n.split()[0] for n in cluster_only_notes(resourced, None)] == [
        "spec.replicas",
        "spec.resources",
    ]
    routed = _llmi(ROOT / "crds" / "examples" / "qwen-7b-autoscaled.yaml")
    notes = " | ".join(cluster_only_notes(routed, None))
    assert "spec.autoscaling" in notes and "spec.router" in notes
    pods = _llmi(ROOT / "crds" / "examples" / "llama-70b-npu-tp8.yaml")
    assert any(n.startswith("spec.pod ") for n in cluster_only_notes(pods, None))
    spec = {**plain.spec.model_dump(by_alias=True, exclude_none=True), "replicas": 3}
    spec["model"] = {**spec["model"], "cache": {"claimName": "models"}}
    both = LLMInference.model_validate({**plain.model_dump(by_alias=True), "spec": spec})
    notes = cluster_only_notes(both, None)
    assert [n.split()[0] for n in notes] == ["spec.replicas", "spec.model.cache"]
    assert [n.split()[0] for n in cluster_only_notes(both, 1)] == ["spec.model.cache"]
    spec = {**spec, "replicas": 0, "image": "registry.example/brook-engine:1"}
    off = LLMInference.model_validate({**plain.model_dump(by_alias=True), "spec": spec})
    notes = cluster_only_notes(off, None)
    assert notes[0].startswith("spec.replicas: spec.replicas is 0") and "runs one" in notes[0]
    assert notes[1].startswith("spec.image registry.example/brook-engine:1")


def test_cli_refusals_name_the_flag(
    make_tiny_model: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    example = str(ROOT / "crds" / "examples" / "tiny-cpu.yaml")
    folder = str(make_tiny_model("llama"))
    assert main(["up", "-f", example, "--model", folder, "--replicas", "2"]) == 2
    assert "--replicas 2: `brook up` runs one replica" in capsys.readouterr().err
    everything = str(ROOT / "crds" / "examples")
    assert main(["up", "-f", everything, "--model", folder]) == 2
    assert "pick one with --name" in capsys.readouterr().err


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_brook_up_serves_the_example_and_drains_on_a_signal(
    stop: signal.Signals,
    make_tiny_model: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = make_tiny_model("llama")
    example = ROOT / "crds" / "examples" / "tiny-cpu.yaml"
    port = free_port()
    log_path = tmp_path / "up.log"
    command = [sys.executable, "-m", "brook_operator.cli", "up", "-f", str(example)]
    command += ["--model", str(folder), "--port", str(port)]
    monkeypatch.setenv("BROOK_LOCAL_DIR", str(tmp_path / "running"))  # for `monitor --local`
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    handle = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, None)
    try:
        _wait_ready(handle)
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0)
        prompt = [5, 6, 7, 8, 9, 10]
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        kv = {"num_blocks": 256, "layer_policies": [{"start": 0.0, "end": 1.0, "dtype": "auto"}]}
        kv["dynamic_precision"] = {"enabled": False}  # as the example's kvCache
        offline = LLM(str(folder), dtype="float32", device="cpu", progress=False, kv_cache=kv)
        [expected] = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0))
        assert reply.choices[0].text == expected.outputs[0].text
        # `brook monitor --local` finds the server and reads its figures
        assert main(["monitor", "--local", "--interval", "0.2"]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split()[:2] == ["NAME", "READY"]
        assert row.split()[:3] == ["tiny-cpu", "1/1", "0%"], row
        assert row.split()[6] != "-"  # TTFT P50/P99 of the request served
        proc.send_signal(stop)
        assert proc.wait(timeout=60) == 0, handle.log()[-3000:]
        # once stopped, it is no longer listed
        assert main(["monitor", "--local"]) == 1
        assert "no `brook up` server is running" in capsys.readouterr().err
        log_text = handle.log()
        assert f"http://127.0.0.1:{port}/v1" in log_text  # the endpoint, said at start
        assert "drain" in log_text.lower()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_brook_up_downloads_an_hf_model_into_the_hub_cache(
    make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """An hf:// manifest without --model: the model is downloaded from the Hub (a stand-in
    on loopback, ``HF_ENDPOINT``) into the Hub's cache, then served; a repository the Hub
    does not have is refused naming the field."""
    folder = make_tiny_model("llama")
    manifest = yaml.safe_load((ROOT / "crds" / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["model"].update(uri="hf://brook-test/tiny-llama", revision="main")
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump(manifest))
    cache = tmp_path / "hub-cache"
    port = free_port()
    with hub.serving(folder, "brook-test/tiny-llama") as stand_in:
        env = {**os.environ, "HF_ENDPOINT": stand_in.url, "HF_HUB_CACHE": str(cache)}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "brook_operator.cli", "up", "-f", str(path)]
        log_path = tmp_path / "up.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        handle = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, None)
        try:
            _wait_ready(handle)
            status, reply = handle.post(
                "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
            )
            assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, handle.log()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        snapshot = cache / "models--brook-test--tiny-llama" / "snapshots" / hub.COMMIT
        assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").exists()
        assert any("/revision/main" in p for p in stand_in.paths)
        assert "downloading hf://brook-test/tiny-llama" in handle.log()
        missing = path.read_text().replace("brook-test/tiny-llama", "brook-test/missing")
        path.write_text(missing)
        refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "spec.model.uri 'hf://brook-test/missing': the download failed" in refused.stderr
    assert "--model FOLDER" in refused.stderr


def _wait_ready(handle: ServerProcess) -> None:
    """Until the server answers /ready (its log in the failure when it exits or takes
    three minutes)."""
    deadline = time.monotonic() + 180
    while not _ready(handle):
        assert handle.proc.poll() is None, handle.log()[-3000:]
        assert time.monotonic() < deadline, handle.log()[-3000:]
        time.sleep(0.2)


def _ready(handle: ServerProcess) -> bool:
    try:
        return handle.get("/ready", auth=False)[0] == 200
    except OSError:
        return False
