"""Architectures Sluice runs, one file each, looked up by config.json's model_type."""

from sluice.errors import CheckpointError
from sluice.models.base import Architecture, ExpertSpec, Layer, MoEBlock, ResidentModel
from sluice.models.deepseek_v3 import DeepseekV3
from sluice.models.deepseek_v4 import DeepseekV4
from sluice.models.gpt_oss import GptOss
from sluice.models.mixtral import Mixtral
from sluice.models.nemotron_h import NemotronH, NemotronHOmni
from sluice.models.qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeText
from sluice.models.qwen3_moe import Qwen3Moe
from sluice.models.qwen3_next import Qwen3Next

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (NemotronH(), Qwen3Moe(), Qwen3Next(), Mixtral(), DeepseekV3(), GptOss(),
                                                                    Qwen3_5Moe(), Qwen3_5MoeText(), DeepseekV4(), NemotronHOmni())}


def get_architecture(model_type: str) -> Architecture:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; Sluice supports: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


__all__ = ["ARCHITECTURES", "Architecture", "ExpertSpec", "Layer", "MoEBlock", "ResidentModel", "get_architecture"]
