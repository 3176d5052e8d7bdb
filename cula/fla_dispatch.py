"""cula's kernels behind FLA 0.6.0's own dispatch (``fla.backends``), so that code calling FLA runs them unchanged.

``import cula`` registers one FLA backend, ``backend_type = "cula"`` (``cula._fla_backend``), for the entry points
FLA dispatches that cula's kernels speed up:

- ``fla.ops.kda.chunk_kda`` (FLA's registry of that function): the calls ``cula.kda.chunk_kda`` runs on its
  ``cula-sm90`` backend, inference and training (FLA dispatches before its autograd Function, so a training call
  gets cula's forward kernels and cula's backward, ``_ChunkKDATraining``);
- ``fused_recurrent_kda_fwd`` (FLA's ``'kda'`` registry): the state-pool decode step that ``kda_decode`` runs;
- ``chunk_gated_delta_rule`` (FLA's ``'gated_delta_rule'`` registry, at ``GDN_PRIORITY``: after FlashQLA): the
  calls ``cula.gated_delta_rule`` runs on its ``cula-sm90`` backend (its GPU tuning entry decides which inference
  calls that is), inference and training (FLA's own Gated DeltaNet backward refuses to run on Hopper with the
  Triton PyTorch ships);
- ``chunk_kda_bwd_wy_dqkg_fused`` (``'kda'``): the stage of FLA's backward that ``cula.kda.fla_backward`` runs on
  cula's kernel (or FLA's at a faster configuration), for the training calls FLA's own path keeps (context
  parallel, say);
- ``chunk_bwd_dqkwg`` (``'common'``), the gated calls only, where FLA's Triton kernel refuses them (Hopper with
  Triton 3.4.0 to 3.7.0, FLA issue #640) and TileLang is not installed: ``cula.common.chunk_o`` runs them, so the
  backwards of FLA's Gated DeltaNet, Simple GLA with a data-dependent ``g``, Comba and their kin complete on Hopper.

Each verifier runs cula's own validation and the ``cula-sm90`` backend's availability probe and ``supports``, the
code ``cula.kda`` selects with, so FLA hands cula exactly the calls cula's kernels would run; everything else goes on
to FLA's next backend (FlashKDA, then FLA's Triton kernels), the reason logged once by FLA's ``fla.backends`` logger
and once per distinct reason by the ``cula`` logger.

``PRIORITY`` is 2: FLA tries lower numbers first and FlashKDA registers at 3 (Gated DeltaNet: ``GDN_PRIORITY``).
``FLA_CULA=0`` turns the backend off (FLA reads it on every call, as it does ``FLA_FLASH_KDA``);
``FLA_DISABLE_BACKEND_DISPATCH=1`` turns off FLA's dispatch altogether; ``CULA_BACKEND`` set to anything but
``cula-sm90`` makes the verifiers decline.

Import order: importing FLA takes a second or more (torch, triton) while ``import cula`` must stay cheap, and the
registry of FLA's ``chunk_kda`` exists only once ``fla.ops.kda.chunk`` has run. So ``install()`` (run by ``import
cula``) registers at once when that module is loaded, and otherwise puts a finder on ``sys.meta_path`` that leaves
the module to its usual loader and registers right after it ran: either import order works. Nothing here imports
FLA, torch or the rest of cula.

Recursion: cula's own ``fla`` backends call FLA's dispatched functions, which ask this backend again. The verifiers
accept only what ``cula-sm90`` runs (never cula's ``fla`` backend), and while a call FLA dispatched to cula runs,
they decline every nested call (a context variable).
"""

import sys

BACKEND_TYPE = "cula"
ENV_VAR = "FLA_CULA"
PRIORITY = 2
# FLA's 'gated_delta_rule' registry: after FlashQLA's backend (3; FLA runs it where the flash_qla package is installed),
# whose published H200 times beat cula's on the Gated DeltaNet anchors (0.877 against 1.73 ms at one 32K sequence
# with 32 value heads) and which trains in fused kernels; cula takes what FlashQLA declines (the fused gate, the
# beta sigmoid, allow_neg_eigval) and everything where it is not installed, before FLA's Triton kernels
GDN_PRIORITY = 4
# the backend of cula's registries the verifiers ask
CULA_BACKEND = "cula-sm90"

# the module whose execution creates the registry of FLA's chunk_kda (``@dispatch`` on the function)
_FLA_CHUNK_MODULE = "fla.ops.kda.chunk"

_state = {"registered": False, "why": "FLA's KDA ops are not imported yet"}


def registered() -> bool:
    """Whether cula's backend is registered with FLA's dispatch in this process (with FLA's current ``chunk_kda``)."""
    return _state["registered"] and _in_chunk_registry()


def status() -> str:
    """Why cula's backend is or is not registered with FLA's dispatch."""
    return _state["why"]


def install() -> None:
    """Register with FLA's dispatch now if FLA's KDA ops are loaded, else as soon as they are."""
    module = sys.modules.get(_FLA_CHUNK_MODULE)
    if module is not None and hasattr(module, "chunk_kda"):
        register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def register() -> bool:
    """Register cula's backend with FLA's dispatch (idempotent; imports FLA's KDA ops if they are not yet). False, with
    ``status()`` saying why, where FLA's dispatch is off or not the one cula knows. Never raises: it runs inside the
    import of FLA's module."""
    if _state["registered"] and _in_chunk_registry():
        return True
    _remove_finder()
    try:
        import importlib

        # sys.modules first: from the import hook, FLA's chunk module is still being imported
        chunk_module = sys.modules.get(_FLA_CHUNK_MODULE) or importlib.import_module(_FLA_CHUNK_MODULE)
        fla_backends = sys.modules.get("fla.backends") or importlib.import_module("fla.backends")
        if getattr(fla_backends, "_DISPATCH_DISABLED", False):
            _state["why"] = "FLA_DISABLE_BACKEND_DISPATCH=1: FLA dispatches nothing"
            return False
        from cula._fla_backend import backend_class, gdn_backend_class

        backend = backend_class(fla_backends.BaseBackend)
        fla_backends.register(chunk_module.chunk_kda)(backend)
        fla_backends.register("kda")(backend)
        fla_backends.register("gated_delta_rule")(gdn_backend_class(fla_backends.BaseBackend))
        fla_backends.register("common")(backend)
    except Exception as error:  # another FLA: cula.kda works as ever, FLA's calls stay FLA's
        import logging

        _state["why"] = f"FLA's dispatch is not usable ({type(error).__name__}: {error})"
        logging.getLogger("cula").warning("cula is not registered with FLA's dispatch: %s", _state["why"])
        return False
    _state.update(registered=True, why=f"registered as FLA backend {BACKEND_TYPE!r} at priority {PRIORITY}")
    return True


def _in_chunk_registry() -> bool:
    """Whether FLA's current ``chunk_kda`` still has cula among its backends (a reload of FLA's chunk module makes a
    new function with an empty registry; True where that cannot be told)."""
    chunk_module, fla_backends = sys.modules.get(_FLA_CHUNK_MODULE), sys.modules.get("fla.backends")
    if chunk_module is None or fla_backends is None or not hasattr(chunk_module, "chunk_kda"):
        return True
    try:
        import inspect

        registry = getattr(fla_backends, "_function_registries", {}).get(inspect.unwrap(chunk_module.chunk_kda))
    except Exception:
        return True
    return registry is None or BACKEND_TYPE in getattr(registry, "_backends", {BACKEND_TYPE: None})


class _RegisterAfterImport:
    """A ``sys.meta_path`` finder that leaves FLA's chunk module to the finder that would load it, and registers
    cula's backend right after the module ran."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _FLA_CHUNK_MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if getattr(spec.loader, "exec_module", None) is not None:
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


class _ThenRegister:
    """A module loader that runs ``loader`` and then ``register()``; everything else is ``loader``'s."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register()

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterAfterImport)]
