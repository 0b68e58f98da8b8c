"""The InferencePool / InferenceModel API: types, validation, loading, CRD generation, status.

Pure data and validation; nothing here performs network I/O. Import the submodules directly
(`poolkeeper.api.model`, `poolkeeper.api.pool`, `poolkeeper.api.load`, ...).
"""
