"""Certificates: the one module that states, signs, stores and judges every kind (service)
and the certificate reads and verification (routes). Below the domains that issue them
(bounds, robustness, training); `POST /certify`, `lsa certify` and `lsa verify`, which reach
into those domains, are service.certify's."""
