"""Leaves every hintfs process uses: the one path resolver (`paths`), the error type that carries
an errno and a reason (`errors`), and secret (token) files (`secrets`). Nothing here imports
another hintfs package."""
