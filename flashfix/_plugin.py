"""Entry point for the engines' own plugin loaders (``vllm.general_plugins``, ``sglang.srt.plugins``).

Deployments that allow-list plugins (``VLLM_PLUGINS``, ``SGLANG_PLUGINS``) see flashfix by
name. Loading it is the same activation as ``import flashfix`` and the ``.pth`` hook: all
three end in ``flashfix.activate()``, and each patch applies at most once per process
however many of them fire (vLLM may load plugins several times in one process).
"""


def register():
    import logging

    import flashfix

    flashfix.activate()
    logging.getLogger("flashfix").debug("loaded through an engine plugin loader")
