import json, inspect, msgspec
from vllm import SamplingParams
fields = SamplingParams.__struct_fields__
defaults = SamplingParams.__struct_defaults__
nodef = len(fields) - len(defaults)
out = {}
for i, f in enumerate(fields):
    d = defaults[i - nodef] if i >= nodef else "<required>"
    if d is msgspec.NODEFAULT: d = "<required>"
    elif isinstance(d, msgspec._core.Factory): d = f"factory:{d.factory.__name__}()"
    out[f] = repr(d) if not isinstance(d, str) or not d.startswith(("<", "factory")) else d
sig = inspect.signature(SamplingParams.__init__)
params = set(sig.parameters) - {"self"}
print("n fields", len(fields), "| constructor params", len(params))
print("fields not accepted by __init__:", [f for f in fields if f not in params])
print("init params not fields:", sorted(params - set(fields)))
print("underscore fields:", [f for f in fields if f.startswith("_")])
print("kw_only / type:", SamplingParams.__struct_config__)
sp = SamplingParams()
for f in fields: print(f"  {f} = {out[f]}   (instance: {getattr(sp, f)!r})")
json.dump(out, open("sampling_fields.json", "w"), indent=1)
print("from_optional sig:", inspect.signature(SamplingParams.from_optional))
