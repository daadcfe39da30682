"""The drivers that walk one graph around one input: the centre's forward pass, the Jacobian
enclosure's walk and its public entry point, the affine margins' entry point.
"""
