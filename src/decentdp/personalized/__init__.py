"""Personalized and private peer-to-peer learning (Bellet, Guerraoui, Taziki, Tommasi, AISTATS 2018).

Each agent learns its own linear model, pulled towards similar agents' models on a weighted graph,
by asynchronous block coordinate descent under Poisson clocks, optionally with Laplace or Gaussian
noise on each update (budgets per agent over its own wake-ups).  Modules: ``objective`` (eq. (2)),
``schedule`` (wake-ups and their exact batching), ``solver`` (eq. (4)/(6), model propagation),
``privacy`` (calibration, allocation, the paper's composition), ``local`` (local models, private
warm start), ``admm`` (the ADMM baseline), ``runner`` (config to results), ``settings`` (the
``[personalized]`` config section).
"""
