"""The paper's analyses (Fig. 6, Fig. 7, App. D.7-D.8) as arrays, and the figures drawn from them."""
from .attention import (
    attention_rollout,
    grad_cam,
    grad_rollout,
    iter_attention,
    layer_head_maps,
    mean_attention_distance,
    mean_attention_distance_from,
    patch_distances,
    rollout,
)
from .embeddings import embedding_filters, filter_principal_components, position_embedding_grid, position_similarity

__all__ = ["attention_rollout", "grad_cam", "grad_rollout", "iter_attention", "layer_head_maps", "mean_attention_distance",
           "mean_attention_distance_from", "patch_distances", "rollout", "embedding_filters",
           "filter_principal_components", "position_embedding_grid", "position_similarity"]
