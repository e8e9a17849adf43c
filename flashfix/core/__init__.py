"""The mechanism: post-import hooks, the patch registry and its gates, reading and recompiling engine source. Knows no engine."""
