"""Entry point for the engines' own plugin loaders (``vllm.general_plugins``, ``sglang.srt.plugins``).

Both loaders call a registered plugin with no arguments, in every engine process (vLLM: API
server, engine core, workers; SGLang 0.5.12+: engine and scheduler processes). Deployments
that allow-list plugins (``VLLM_PLUGINS``, ``SGLANG_PLUGINS``) see flashfix by name. Loading
it is the same activation as ``import flashfix`` and the ``.pth`` hook: all three end in
``flashfix.activate()``, and each patch applies at most once per process however many of
them fire (vLLM may load plugins several times in one process).
"""

_announced = []


def register():
    import os

    import flashfix
    from flashfix.core import registry as _registry

    flashfix.activate()
    if flashfix._activation_error is not None:  # strict mode: an affected module imported before flashfix
        raise flashfix._activation_error
    if not _announced:
        _announced.append(True)
        _registry.setup_logging()
        _registry.log.info("flashfix %s loaded by an engine plugin loader in pid %d", flashfix.__version__, os.getpid())
