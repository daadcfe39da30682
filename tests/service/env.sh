# Source me to run the service tests against the real servers, as CI does.
export LSA_TEST_POSTGRES_URL="${LSA_TEST_POSTGRES_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}"
export LSA_TEST_REDIS_URL="${LSA_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
