#!/bin/bash
grep river data.txt > answer.txt
