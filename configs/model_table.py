"""Model dimensions: one table, each entry citing where its numbers come from.

Config files (`llama_13b.py`, `llama3_8b.py`, `small.py`, `tiny.py`, and the published
setups' `mistral_7b.py`, `yi_34b.py`, `opt_13b.py`, `llama2_70b.py`, `llama3_70b.py`)
read from here; so do tests. `positions="learned"` with `ffn_matrices=2` (OPT) is a shape
for the capacity model and the simulator only: the JAX model is Llama's.
"""

MODEL_TABLE: dict[str, dict] = {
    "llama2_13b": dict(
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        d_model=5120,
        ffn_dim=13824,
        vocab_size=32000,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=4096,
        source="Touvron et al. 2023, 'Llama 2' (Table 1/A.2) and the released config.json: "
        "40 layers, 40 heads, d_model 5120, FFN 13824, vocab 32000, context 4096",
    ),
    "llama3_8b": dict(
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        d_model=4096,
        ffn_dim=14336,
        vocab_size=128256,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_seq_len=8192,
        source="Meta Llama 3 model card and released config.json (8B): 32 layers, 32 heads, "
        "8 KV heads (GQA), d_model 4096, FFN 14336, vocab 128256, rope_theta 5e5",
    ),
    "mistral_7b": dict(
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        d_model=4096,
        ffn_dim=14336,
        vocab_size=32000,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=32768,
        source="Jiang et al. 2023, 'Mistral 7B' (Table 1) and the released config.json "
        "(v0.1): 32 layers, 32 heads, 8 KV heads, d_model 4096, FFN 14336, vocab 32000, "
        "context 32768 (sliding window 4096, not modelled)",
    ),
    "yi_34b": dict(
        num_layers=60,
        num_heads=56,
        num_kv_heads=8,
        head_dim=128,
        d_model=7168,
        ffn_dim=20480,
        vocab_size=64000,
        tie_embeddings=False,
        rope_theta=5000000.0,
        norm_eps=1e-5,
        max_seq_len=4096,
        source="01.AI, 'Yi: Open Foundation Models' (2024) and the released config.json of "
        "Yi-34B: 60 layers, 56 heads, 8 KV heads, d_model 7168, FFN 20480, vocab 64000, "
        "rope_theta 5e6 (Yi-34B-200K, Sarathi-Serve's model, has the same shapes)",
    ),
    "opt_13b": dict(
        num_layers=40,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        d_model=5120,
        ffn_dim=20480,
        vocab_size=50272,
        tie_embeddings=True,
        positions="learned",
        learned_positions=2050,
        ffn_matrices=2,
        norm_eps=1e-5,
        max_seq_len=2048,
        source="Zhang et al. 2022, 'OPT' (Table 1) and the released config.json of "
        "facebook/opt-13b: 40 layers, 40 heads (MHA), d_model 5120, FFN 20480 (fc1, fc2, "
        "ReLU), vocab 50272, learned positions (2048 + 2 rows), tied embeddings",
    ),
    "llama2_70b": dict(
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        d_model=8192,
        ffn_dim=28672,
        vocab_size=32000,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=4096,
        source="Touvron et al. 2023, 'Llama 2' and the released config.json (70B): 80 "
        "layers, 64 heads, 8 KV heads (GQA), d_model 8192, FFN 28672, vocab 32000",
    ),
    "llama3_70b": dict(
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        d_model=8192,
        ffn_dim=28672,
        vocab_size=128256,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_seq_len=8192,
        source="Meta Llama 3 model card and released config.json (70B): 80 layers, 64 "
        "heads, 8 KV heads, d_model 8192, FFN 28672, vocab 128256, rope_theta 5e5",
    ),
    "tiny": dict(
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        d_model=256,
        ffn_dim=512,
        vocab_size=512,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=2048,
        source="kvpage's own toy model: a few milliseconds per step on a laptop CPU",
    ),
    "small": dict(
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        d_model=512,
        ffn_dim=1536,
        vocab_size=1024,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_seq_len=2048,
        source="kvpage's own CPU model: 25M parameters, GQA 4:1, big enough that the "
        "matmuls, not the host, set a CPU step's time",
    ),
}
