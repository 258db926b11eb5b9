"""modules.small_config under the config's own names for the common sizes (its class's attribute_map:
GPT-J's n_embd and n_head, XGLM's d_model, CTRL's dff): the small instance that `train` runs to check
a model type, and the tests and the model table train, is small for those types too."""

import pytest
from transformers import AutoConfig

from megatrain_ray.models.transformers import modules as hm


@pytest.mark.parametrize("model_type", ["gptj", "codegen", "xglm", "ctrl", "gpt2"])
def test_a_config_that_names_its_sizes_its_own_way_is_made_small(model_type):
    config = {k: v for k, v in AutoConfig.for_model(model_type).to_dict().items() if k != "transformers_version"}
    small = hm.small_config(config, hm.decoder_parts(hm.build_empty(config)).kinds)
    model = hm.build_small(small)
    text = model.config.get_text_config()
    assert text.hidden_size <= hm.SMALL["hidden_size"] and text.num_attention_heads <= hm.SMALL["num_attention_heads"]
    assert sum(p.numel() for p in model.parameters()) < 500_000  # GPT-J's was 201 M a layer before
