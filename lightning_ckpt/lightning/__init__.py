"""The PyTorch Lightning integration: the callback, the conditions a saved plan is reused under, and the
budget guard on real steps. Lightning is imported only here.
"""
