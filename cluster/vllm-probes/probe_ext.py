"""Worker extension for the probes: mixed into vLLM's worker class via worker_extension_cls."""
import datetime, torch
import torch.distributed as dist


class ProbeExt:
    def probe_info(self):
        m = self.model_runner.model
        return {"worker_mro": [c.__module__ + "." + c.__name__ for c in type(self).__mro__][:6],
                "model_runner": type(self.model_runner).__name__, "model_cls": type(m).__name__,
                "get_model_is_model": self.model_runner.get_model() is m,
                "params": [(n, list(p.shape), str(p.dtype)) for n, p in m.named_parameters()],
                "rank": getattr(self, "rank", None), "pid": __import__("os").getpid()}

    def probe_args(self, *args, **kwargs):
        "What the worker receives: types of args and kwargs."
        def desc(x):
            if isinstance(x, (list, tuple)): return [desc(y) for y in x][:3]
            if isinstance(x, dict): return {k: desc(v) for k, v in list(x.items())[:3]}
            if isinstance(x, torch.Tensor): return f"Tensor{tuple(x.shape)} {x.dtype}"
            return type(x).__name__
        return {"args": desc(args), "kwargs": desc(kwargs)}

    def load_plain(self, named):
        "Plain model.load_weights (what GPU recipes do): fails on CPU for repacked linears."
        loaded = self.model_runner.model.load_weights(weights=iter(named))
        return {"type": type(loaded).__name__, "names": sorted(loaded) if loaded is not None else None}

    def load_layerwise(self, named):
        "vLLM's in-place reload: initialize_layerwise_reload, model.load_weights, finalize_layerwise_reload."
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload, finalize_layerwise_reload
        model = self.model_runner.get_model()
        initialize_layerwise_reload(model)
        loaded = model.load_weights(weights=iter(named))
        finalize_layerwise_reload(model, self.model_runner.model_config)
        return {"type": type(loaded).__name__, "names": sorted(loaded)}

    def load_via_worker_reload(self, named):
        "Worker.reload_weights(weights_iterator=...), the public in-place path (returns None)."
        return repr(self.reload_weights(weights_iterator=iter(named)))

    def gloo_receive(self, host, port, world, rank, metas):
        "Join a TCPStore + ProcessGroupGloo as `rank`, receive one flat float32 buffer from rank 0, load it."
        store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
        total = sum(n for _, _, n in metas)
        buf = torch.empty(total, dtype=torch.float32)
        pg.broadcast(buf, 0).wait()
        named, off = [], 0
        for name, shape, n in metas:
            named.append((name, buf[off:off + n].view(shape)))
            off += n
        loaded = self.load_layerwise(named)["names"]
        return {"received_sum": float(buf.sum()), "loaded": loaded}

    def load_plain_local(self):
        "plain load_weights of a locally made q_proj tensor (no RPC serialization involved)"
        m = self.model_runner.model
        w = torch.zeros(128, 128)
        loaded = m.load_weights(weights=iter([("model.layers.0.self_attn.q_proj.weight", w)]))
        return sorted(loaded)

    def lm_head_check(self, refresh=False):
        "Is the packed CPU lm_head in step with embed_tokens.weight? Optionally re-run its weight processing."
        m = self.model_runner.get_model()
        lm, emb = m.lm_head, m.model.embed_tokens
        if refresh:
            lm.quant_method.process_weights_after_loading(lm)
        h = torch.randn(3, emb.weight.shape[1], generator=torch.Generator().manual_seed(0))
        ref = torch.nn.functional.linear(h, emb.weight)
        got = lm.quant_method.apply(lm, h)
        return {"lm_head_cls": type(lm).__name__, "lm_head_is_embed": lm is emb, "same_weight_storage": lm.weight.data_ptr() == emb.weight.data_ptr(),
                "has_cpu_linear": hasattr(lm, "cpu_linear"), "max_abs_diff_vs_embed": float((ref - got).abs().max())}

    def load_from_file(self, path):
        "Layerwise reload of a safetensors file read inside the worker (no RPC tensors)."
        from safetensors.torch import load_file
        return self.load_layerwise(list(load_file(path).items()))

    def probe_args2(self, *args):
        import numpy as np
        return [type(a).__name__ + (f" {a.dtype} {a.shape}" if hasattr(a, "shape") else f" len {len(a)}" if hasattr(a, "__len__") else "") for a in args]
