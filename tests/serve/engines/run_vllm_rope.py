"""vLLM's own rotary modules for folders' configs, run in vLLM's environment (no model load).

    python run_vllm_rope.py OUT.json FOLDER:MAX_MODEL_LEN [FOLDER:MAX_MODEL_LEN ...]

For each folder: builds ``get_rope`` exactly as vLLM's Llama does (head size, max_position =
max_position_embeddings, the config's rope_parameters, neox style, float32) and reads the
per-pair frequency and the cos/sin scale back from its cache row at position 1:
theta_f = atan2(sin, cos) (every theta_f < pi here), factor = hypot(cos, sin). longrope reads
vLLM's max_model_len from the current config; it is set to MAX_MODEL_LEN for that call
(everything else sees a default ``VllmConfig``, which CustomOp needs to be built).
Writes {folder: {"inv_freq": [...], "attention_factor": x, "cache_rows": n}}.
"""

import json
import math
import sys
import types
from pathlib import Path


def main() -> int:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as phi3

    out, pairs = sys.argv[1], sys.argv[2:]
    result = {}
    for pair in pairs:
        folder, max_model_len = pair.rsplit(":", 1)
        config = json.loads((Path(folder) / "config.json").read_text())
        head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        current = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=int(max_model_len))
        )
        phi3.get_current_vllm_config = lambda current=current: current
        rotary_embedding._ROPE_DICT.clear()
        with set_current_vllm_config(VllmConfig()):  # CustomOp reads the current config
            rope = rotary_embedding.get_rope(
                head,
                max_position=config["max_position_embeddings"],
                is_neox_style=True,
                rope_parameters=config["rope_parameters"],
                dtype=torch.float32,
            )
        if hasattr(rope, "long_short_cos_sin_cache"):
            cache = rope.long_short_cos_sin_cache
            offset = rope.original_max_position_embeddings if rope.use_long_rope else 0
        else:
            cache, offset = rope.cos_sin_cache, 0
        row = cache[offset + 1].double()
        cos, sin = row.chunk(2)
        result[folder] = {
            "inv_freq": [math.atan2(float(s), float(c)) for c, s in zip(cos, sin, strict=True)],
            "attention_factor": float(torch.hypot(cos, sin).mean()),
            "cache_rows": int(cache.shape[0] - offset),
        }
    Path(out).write_text(json.dumps(result))
    print("RESULT " + json.dumps({"folders": len(result)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
