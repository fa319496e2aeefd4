"""The served formats a merge can be written in (``quantize``), by name, without importing torch (the command line's
help lists them)."""

#: the names ``--quantize`` takes, in the order the help lists them
NAMES = ("fp8-block", "ct-fp8-block", "ct-w4a16", "nf4", "fp4", "int8", "base")
#: formats that need calibration data, refused by name with the hand-off
CALIBRATED = {"gptq": "GPTQ", "awq": "AWQ"}
