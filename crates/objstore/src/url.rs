//! `s3://BUCKET/PREFIX` volume addresses and the store they name, set up
//! from the standard AWS environment (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`,
//! `AWS_ALLOW_HTTP`, ...), as every S3 tool reads it.
use object_store::aws::AmazonS3Builder;
use object_store::ObjectStore;
use std::sync::Arc;

/// A parsed `s3://BUCKET/PREFIX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Url {
    pub bucket: String,
    pub prefix: String,
}

/// Is this argument an object-store volume rather than a path?
pub fn is_object_url(s: &str) -> bool {
    s.starts_with("s3://")
}

/// Why an address is not a volume's, or its store cannot be set up.
#[derive(Debug)]
pub enum UrlError {
    /// Not `s3://...`.
    NotS3 { url: String },
    /// The bucket name breaks S3's rules.
    Bucket { url: String, bucket: String },
    /// No prefix after the bucket.
    NoPrefix { url: String, bucket: String },
    /// A prefix with an empty, `.` or `..` part.
    Prefix { url: String, prefix: String },
    /// The client could not be built from the environment.
    Client {
        bucket: String,
        source: object_store::Error,
    },
}

impl std::fmt::Display for UrlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UrlError::NotS3 { url } => write!(f, "{url}: not an s3://BUCKET/PREFIX address"),
            UrlError::Bucket { url, bucket } => write!(
                f,
                "{url}: '{bucket}' is not a bucket name (3 to 63 lower-case letters, digits, '-', '.')"
            ),
            UrlError::NoPrefix { url, bucket } => write!(
                f,
                "{url}: give the volume a prefix in the bucket: s3://{bucket}/NAME"
            ),
            UrlError::Prefix { url, prefix } => write!(
                f,
                "{url}: the prefix '{prefix}' has an empty, '.' or '..' part"
            ),
            UrlError::Client { bucket, source } => write!(f, "s3://{bucket}: {source}"),
        }
    }
}

impl std::error::Error for UrlError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            UrlError::Client { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// For callers that report errors as text (the CLI's commands).
impl From<UrlError> for String {
    fn from(e: UrlError) -> String {
        e.to_string()
    }
}

impl S3Url {
    pub fn parse(s: &str) -> Result<S3Url, UrlError> {
        let url = || s.to_string();
        let rest = s
            .strip_prefix("s3://")
            .ok_or_else(|| UrlError::NotS3 { url: url() })?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
        if !bucket_ok {
            return Err(UrlError::Bucket {
                url: url(),
                bucket: bucket.to_string(),
            });
        }
        if prefix.is_empty() {
            return Err(UrlError::NoPrefix {
                url: url(),
                bucket: bucket.to_string(),
            });
        }
        if prefix
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(UrlError::Prefix {
                url: url(),
                prefix: prefix.to_string(),
            });
        }
        Ok(S3Url {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// The bucket's client, configured from the environment.
    pub fn store(&self) -> Result<Arc<dyn ObjectStore>, UrlError> {
        let s3 = AmazonS3Builder::from_env()
            .with_bucket_name(&self.bucket)
            .build()
            .map_err(|source| UrlError::Client {
                bucket: self.bucket.clone(),
                source,
            })?;
        Ok(Arc::new(s3))
    }
}

impl std::fmt::Display for S3Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why_not() {
        let u = S3Url::parse("s3://my-bucket/vols/a/").expect("valid");
        assert_eq!(
            (u.bucket.as_str(), u.prefix.as_str()),
            ("my-bucket", "vols/a")
        );
        assert_eq!(u.to_string(), "s3://my-bucket/vols/a");
        assert!(S3Url::parse("s3://my-bucket")
            .unwrap_err()
            .to_string()
            .contains("prefix"));
        assert!(S3Url::parse("s3://My_Bucket/x")
            .unwrap_err()
            .to_string()
            .contains("bucket"));
        assert!(S3Url::parse("s3://bkt/a//b").is_err());
        assert!(S3Url::parse("s3://bkt/../b").is_err());
        assert!(S3Url::parse("/tmp/x").is_err());
    }
}
