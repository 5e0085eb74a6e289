"""Cross-cutting mechanics that every layer uses: the error types (``errors``), strict JSON (``strictjson``),
files opened without following links (``safefiles``), seed derivation (``seeding``), torch thread settings
(``threads``) and the per-client-call deadline (``calltimer``). The bottom layer: it imports nothing else from the
core.
"""
