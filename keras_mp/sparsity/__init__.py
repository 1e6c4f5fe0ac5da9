"""2:4 structured sparsity: masks, the `fit` callback, the report and the
channel permutation. Guide: `docs/sparsity.md`."""

from keras_mp.sparsity.callback import StructuredSparsity
from keras_mp.sparsity.masks import (
    SparsityMask,
    is_2_4_sparse,
    magnitude_mask,
)
from keras_mp.sparsity.model import sparse_layers, strip_sparsity
from keras_mp.sparsity.permutation import (
    permute_for_sparsity,
    search_permutation,
)
from keras_mp.sparsity.report import (
    SparsityReport,
    plot_sparsity,
    sparsity_report,
)
from keras_mp.sparsity.saving import SparseModel
