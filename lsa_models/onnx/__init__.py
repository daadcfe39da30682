"""ONNX models: safe loading, a torch evaluator, the op registry, attention recognition,
certified bounds and export."""
