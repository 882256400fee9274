from .mxfp4 import E2M1_VALUES, MXFP4_BLOCK, dequantize_mxfp4, e2m1_table, unpack_e2m1

__all__ = ["E2M1_VALUES", "MXFP4_BLOCK", "dequantize_mxfp4", "e2m1_table", "unpack_e2m1"]
