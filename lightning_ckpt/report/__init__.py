"""What a search shows: the result line, summary tables, progress, the Pareto figure and TensorBoard.
TensorBoard and matplotlib are imported only here.
"""
