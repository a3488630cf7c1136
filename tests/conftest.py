import os, pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    "A private Ray on loopback for the session (its own temp dir; shut down at the end, never `ray stop`)"
    import ray
    from molt_nb.controller import start_ray

    start_ray(temp_dir=str(tmp_path_factory.mktemp("ray")), num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture
def no_checkpoint(monkeypatch):
    """Validation must not resolve the model: any attempt to read the checkpoint fails the test. The memory plan
    (`molt-nb plan`) finds no checkpoint on this machine, as on a laptop planning for a cluster, and reads the
    recipe's model_config.json"""
    from molt_nb import config as config_module, memory

    def refuse(path):
        raise AssertionError(f"validation tried to read the checkpoint {path!r}")

    def absent(path):
        raise ValueError(f"model.path {path!r} is not in this machine's Hugging Face cache (no_checkpoint)")

    monkeypatch.setattr(config_module, 'local_checkpoint', refuse)
    monkeypatch.setattr(memory, 'local_checkpoint', absent)
