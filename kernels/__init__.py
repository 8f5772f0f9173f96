"""Device code of graphalloc (installed as ``graphalloc.kernels``).

Each kernel sits beside its launcher and its Torch reference twin, which
shares the launcher's signature:

* ``release`` -- the step's lookup-and-clear core node (release/evict rows)
* ``allocate`` -- the step's decode/extend allocation
* ``step`` -- both of them in one fused launch (for steps the planner marks fusable)
* ``get_and_clear`` -- the single-call ``get_and_clear_swa_pages`` op
* ``page_table`` -- the attention batch's FULL/SWA page tables (CSR and block-table forms)
* ``paged_attention`` -- paged decode attention reading only those CSR tables
* ``state`` -- recurrent-state slots: the slot table written and state tensors copied
* ``error_word`` -- the device error word both write faults to

Most users want :class:`graphalloc.HybridAllocator`, not these.
"""

if __name__ != "graphalloc.kernels":
    # This folder is the source of graphalloc.kernels. A Python started in the repository
    # root (``python -m pytest``, ``python -c``, a notebook, an example) has the root on
    # sys.path and would find the folder as a top-level ``kernels``, a name an installed
    # package owns (Hugging Face's kernels, which transformers imports): hand that name to
    # the installed package, or refuse it when there is none.
    from ._top_level import hand_over

    hand_over(__name__, __file__)
else:
    from .allocate import allocate_tokens, allocate_tokens_torch
    from .error_word import new_error_word
    from .get_and_clear import get_and_clear_swa_pages, get_and_clear_swa_pages_torch
    from .page_table import write_page_tables, write_page_tables_torch
    from .paged_attention import paged_decode_attention, paged_decode_attention_torch
    from .release import release_pages, release_pages_torch
    from .state import (
        copy_state_rows,
        copy_state_rows_torch,
        state_tensor_spec,
        write_state_rows,
        write_state_rows_torch,
    )
    from .step import run_step_fused, run_step_fused_torch


    def interpreted() -> bool:
        """Whether the kernels were defined under the Triton interpreter (``TRITON_INTERPRET=1``
        set before this package was imported): only then does ``backend="triton"`` run on a CPU
        device. Decided once, at import; setting the variable later changes nothing."""
        from triton.runtime.interpreter import InterpretedFunction

        from .release import _release_kernel

        return isinstance(_release_kernel, InterpretedFunction)


    __all__ = [
        "interpreted",
        "release_pages",
        "release_pages_torch",
        "allocate_tokens",
        "allocate_tokens_torch",
        "run_step_fused",
        "run_step_fused_torch",
        "get_and_clear_swa_pages",
        "get_and_clear_swa_pages_torch",
        "new_error_word",
        "write_page_tables",
        "write_page_tables_torch",
        "paged_decode_attention",
        "paged_decode_attention_torch",
        "write_state_rows",
        "write_state_rows_torch",
        "copy_state_rows",
        "copy_state_rows_torch",
        "state_tensor_spec",
    ]
