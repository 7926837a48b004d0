"""The PyTorch Lightning integration: the callback (``callback``), one fit's state (``session``), reusing a saved
plan (``reuse``), the search on the first batch (``searching``), batch shapes and trials through ``training_step``
(``shapes``), the budget guard on real steps (``guard``), argument checks (``checks``) and the TensorBoard run
(``tensorboard``). Lightning is imported only here.
"""
